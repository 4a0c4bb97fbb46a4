"""This machine, measured: what the planner's `--gpu cpu` and the CPU MFU reference stand on.

hardware.py  matmul, memory and gloo rates, measured once per machine and cached
ranks.py     what each rank of the probe times
peak.py      the reference peak FLOP/s that MFU divides by, and how an MFU is shown
"""
