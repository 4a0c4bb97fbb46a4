"""Small torch-free helpers every layer may use.

words.py     counts in words for messages ("1 file", "2 files")
cache.py     the folder meshtron keeps per-machine measurements and the default corpus in
resident.py  a process's peak resident size, from /proc (not getrusage, which survives exec)
"""
