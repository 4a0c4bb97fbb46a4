"""The data-parallel engines: how parameters, gradients and optimizer state are replicated or sharded
over the data-parallel ranks. parallel/data_parallel.py chooses one per layout.

engine.py           the interface every engine implements (all the training loop calls), clipping
settings.py         what every engine is built from: the layout's options and the groups it uses
ddp.py              DDP: bucketed gradient all-reduce overlapped with backward
zero.py             ZeRO-1/2: optimizer state (and gradients) sharded, reduce-scatter + all-gather
fsdp.py             ZeRO-3 / FSDP / HSDP: parameters sharded in units, gathered per use; TorchFSDP
simple_fsdp.py      SimpleFSDP: the gather as a traced collective torch.compile can bucket
fsdp_float8.py      float8 all-gathers of FSDP units
expert.py           dense and expert parameters over their own groups
shard.py            dim-0 sharding into one flat rank-major buffer
staging.py          persistent communication buffers
mixed_precision.py  bf16 weights with fp32 masters where parameters stay whole
materialize.py      storage for meta-device parameters: each engine asks for what a rank holds
"""
