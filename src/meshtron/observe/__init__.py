"""What a run reports about itself: metrics, traces, memory, stragglers and its records.

metrics.py      each step's row: loss, throughput, MFU, memory, communication (console, JSONL, TensorBoard)
profiling.py    torch.profiler traces of chosen steps, memory by phase
traces.py       the ranks' traces merged into one timeline
cuda_memory.py  the CUDA allocator's history
stragglers.py   the slowest rank, its phase and the others' waits
expert_load.py  tokens per expert, gathered over the ranks
records.py      config.toml and environment.json: what a run was
summary.py      summary.json at the end of a run
wandb_log.py    Weights & Biases
"""
