"""A rank's resident peak against the planner's prediction for its pipeline stage.

  fixed overhead   what is resident after the last step beyond the tensors alive then (every tensor
                   storage Python reaches, counted once): the interpreter, torch's libraries and their
                   workspaces, gloo's process groups and buffers, the allocator's slack; measured in the
                   same process, between steps, where no activation is alive
  measured         the resident peak (VmHWM, observe/metrics.py) over the steps, minus that fixed overhead
  predicted        plan/gpu_memory.py's parts for the rank's stage (plan/estimate.py's `stage_memories`),
                   without a GPU's reserved context; gloo's ZeRO-1 all-reduces whole buckets in place

Run `measure_peak` in a fresh process (a resident peak never falls) with glibc's mmap threshold fixed
(MALLOC_MMAP_THRESHOLD_ set before the process starts: `FIXED_MMAP_THRESHOLD`): with its default dynamic
threshold a freed activation raises the threshold and later ones stay in the heap, so the resident peak
would measure the allocator's history rather than the tensors.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings
from typing import Any

import torch

from meshtron.config.layout import Dim
from meshtron.plan.estimate import Cluster, stage_memories
from meshtron.plan.gpu_memory import MemoryOverhead
from meshtron.plan.hardware import accelerator
from meshtron.rules.checks import load_config
from meshtron.utils.resident import resident_peak_bytes

FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}


def model_overrides(
    dim: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    seq_len: int,
    batch: int,
    micro: int,
) -> list[str]:
    """A model and batch for measuring peaks: byte tokens, no plot, no sample, one warm-up step."""
    model = dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=vocab)
    training = dict(seq_len=seq_len, global_batch=batch, micro_batch=micro, warmup_steps=1)
    return [
        *(f"--model.{k}={v}" for k, v in model.items()),
        *(f"--training.{k}={v}" for k, v in training.items()),
        "--data.tokenizer=byte",
        "--run.plot=false",
        "--run.sample_tokens=0",
    ]


# 30M parameters, sequences of 512: state and activations of a few hundred MB per rank, well above the
# noise of the fixed overhead (about 330 MB a rank).
MID_MODEL = model_overrides(512, 8, 8, 4, 1536, 8192, 512, 8, 2)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage Python can reach (each storage once)."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # gc also meets torch's deprecated module aliases
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_peak(overrides: list[str], steps: int) -> dict[str, Any]:
    """On every rank: `steps` training steps of the config; its pipeline stage, whether it is the first
    rank of its data-parallel and tensor-parallel groups, its fixed overhead and resident peak (bytes)."""
    from meshtron.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    for step in range(steps):
        trainer.step(step)
    mesh = trainer.job.place.mesh
    first = all(mesh.local_rank(dim) == 0 for dim in (Dim.DP_SHARD_CP, Dim.DP_REPLICATE, Dim.TP))
    fixed = resident_bytes() - live_tensor_bytes()
    peak = resident_peak_bytes()
    return {"pp_rank": mesh.local_rank(Dim.PP), "first": first, "fixed": fixed, "peak": peak}


def measure_start_up(overrides: list[str]) -> dict[str, Any]:
    """On every rank of a fresh process: what setting the job up made resident, and the peak it reached,
    before step 1, both beyond what the process held before (bytes)."""
    from meshtron.train.trainer import Trainer

    before = resident_bytes()
    trainer = Trainer(load_config(None, overrides))
    mesh = trainer.job.place.mesh
    first = all(mesh.local_rank(dim) == 0 for dim in (Dim.DP_SHARD_CP, Dim.DP_REPLICATE, Dim.TP))
    return {"first": first, "resident": resident_bytes() - before, "peak": resident_peak_bytes() - before}


def resolved_config(overrides: list[str], world: int) -> Any:
    """The config of `overrides` with dp_shard resolved for `world` ranks (as the planner takes it)."""
    cfg = load_config(None, overrides)
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=cfg.parallel.dp_shard_for(world))
    )


def predicted_stages(overrides: list[str], world: int) -> list[dict[str, float]]:
    """The planner's parts (bytes) per pipeline stage of the config on `world` ranks, without the
    reserved context."""
    cfg = resolved_config(overrides, world)
    dtype = cfg.training.dtype if cfg.training.dtype != "fp32" else "bf16"
    memory = MemoryOverhead(context_bytes=0.0, fragmentation=0.0, in_place_reduce=True)
    cluster = dataclasses.replace(Cluster(accelerator("h100"), world, dtype), memory=memory)
    return [{k: v for k, v in stage.items() if k != "reserved"} for stage in stage_memories(cfg, cluster)]
