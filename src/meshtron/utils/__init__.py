"""Small torch-free helpers every layer may use.

words.py     words for messages: counts ("1 file", "2 files"), the nearest known name
memo.py      the planner's bounded memos
cache.py     the folder meshtron keeps per-machine measurements and the default corpus in
resident.py  a process's peak resident size, from /proc (not getrusage, which survives exec)
"""
