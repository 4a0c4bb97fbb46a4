"""The planner, torch-free: what a layout costs on a cluster, and the search for the best one.

estimate.py      a layout's step time, MFU and memory per stage (the schedule simulated)
search.py        the layouts worth trying for a model on a cluster, ranked
report.py        `meshtron plan`'s tables and JSON
flops.py         model FLOPs per token, the one count the trainer's MFU uses too
state.py         parameters, gradients and optimizer state per rank
muon.py          Muon's Newton-Schulz FLOPs, owners and exchange bytes per rank
memory.py        activations kept per layer (Korthikanti et al. 2022, restated for each layout)
op_memory.py     ...under per-operation recompute
gpu_memory.py    a stage's peak memory by part
buffers.py       the data-parallel engines' communication buffers
comm.py          bytes per group of a step (checked exactly against the comm layer's counts)
comm_time.py     communication time per group, and what overlap hides
routing.py       where a token's experts live: ranks and nodes a token reaches
compute_time.py  compute time per micro-batch and chunk (roofline with measured efficiencies)
hardware.py      GPUs: peaks, memory, links
network.py       link efficiencies
layout.py        a layout written as `tp=8,pp=16,...`
"""
