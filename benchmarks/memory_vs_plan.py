"""The planner's memory per rank against each rank's measured peak on this CPU.

For every layout, a fresh gloo world trains a few steps of a mid-sized model (30M parameters, sequences
of 512: model state and activations of a few hundred MB, well above the noise), and each rank reports:

  fixed overhead   what is resident after the last step beyond the tensors alive then (every tensor
                   storage Python reaches, counted once): the interpreter, torch's libraries and their
                   workspaces (oneDNN's, the BLAS threads'), gloo's process groups and buffers, the
                   allocator's slack; measured in the same process, between steps, where no activation
                   is alive
  measured         its resident peak (ru_maxrss) over the steps, minus that fixed overhead
  predicted        plan/gpu_memory.py's parts for its pipeline stage (params, grads, optimizer,
                   activations with the schedule's micro-batches in flight, transient, the engine's
                   buffers), without the GPU's reserved context (plan/estimate.py's `stage_memories`)

and the ratio measured / predicted. The planner's activation model counts the tensors each layer keeps
for backward (tests/test_activation_memory.py checks it tensor by tensor); what a step holds for a moment
(the loss's gradients, a recomputed layer, AdamW's temporary) and the engines' buffers are modelled too;
what is left is what this benchmark measures.

Usage: python benchmarks/memory_vs_plan.py [--only NAME ...] [--steps N] [--out RESULTS.md | -]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
from pathlib import Path
from typing import Any

import harness
from reporting import RESULTS, cpu_model, table, write_section

from meshtron.checks import load_config
from meshtron.commands.dry_run import resolved
from meshtron.plan.estimate import Cluster, stage_memories
from meshtron.plan.gpu_memory import MemoryOverhead
from meshtron.plan.hardware import accelerator

MiB = 2**20
MODEL = [
    "--model.dim=512", "--model.n_layers=8", "--model.n_heads=8", "--model.n_kv_heads=4",
    "--model.ffn_dim=1536", "--model.vocab_size=8192", "--data.tokenizer=byte", "--training.seq_len=512",
    "--training.global_batch=8", "--training.micro_batch=2", "--run.plot=false", "--run.sample_tokens=0",
    "--training.warmup_steps=1",
]  # fmt: skip
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=768"]
PP = ["--parallel.pp=2", "--training.micro_batch=1"]
# name: (ranks, overrides after MODEL)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "single_selective": (1, ["--training.recompute=selective"]),
    "single_full": (1, ["--training.recompute=full"]),
    "single_bf16": (1, ["--training.dtype=bf16"]),
    "ddp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"]),
    "zero1_2": (2, ["--parallel.zero=1"]),
    "zero2_2": (2, ["--parallel.zero=2"]),
    "zero3_4": (4, ["--parallel.zero=3", "--training.micro_batch=1"]),
    "zero3_4_bf16": (4, ["--parallel.zero=3", "--training.micro_batch=1", "--training.dtype=bf16"]),
    "zero1_2_bf16": (2, ["--parallel.zero=1", "--training.dtype=bf16"]),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp2_sp_selective": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=selective"]),
    "pp2_1f1b": (2, PP),
    "pp2_1f1b_full": (2, [*PP, "--training.recompute=full"]),
    "pp2_interleaved": (2, [*PP, "--parallel.pp_schedule=interleaved", "--parallel.vpp=2"]),
    "pp2_zero_bubble": (2, [*PP, "--parallel.pp_schedule=zero_bubble"]),
    "pp2_zbv": (2, [*PP, "--parallel.pp_schedule=zbv"]),
    "pp2_1f1b_bf16": (2, [*PP, "--training.dtype=bf16"]),
    "cp2_ring": (2, ["--parallel.cp=2"]),
    "ep2_moe": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=1"]),
}


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage Python can reach (each storage once)."""
    import gc

    import torch

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(overrides: list[str], steps: int) -> dict[str, Any]:
    """On every rank: its pipeline stage, whether it is the first of its data-parallel group, its resident
    peak over `steps` steps, and its fixed overhead: what is resident between steps beyond the tensors
    alive then (the model state, the data), measured after the last step."""
    import warnings

    from meshtron.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    for step in range(steps):
        trainer.step(step)
    mesh = trainer.job.place.mesh
    first = all(mesh.local_rank(dim) == 0 for dim in ("dp_shard_cp", "dp_replicate", "tp"))
    with warnings.catch_warnings():  # gc also meets torch's deprecated module aliases
        warnings.simplefilter("ignore")
        fixed = resident() - live_tensor_bytes()
    return {"pp_rank": mesh.local_rank("pp"), "first": first, "fixed": fixed, "peak": maxrss()}


def predicted(overrides: list[str], world: int) -> list[dict[str, float]]:
    """The planner's parts per pipeline stage, without the reserved context."""
    cfg = resolved(load_config(None, overrides), world)
    cluster = Cluster(
        accelerator("h100"), world, cfg.training.dtype if cfg.training.dtype != "fp32" else "bf16"
    )
    memory = MemoryOverhead(context_bytes=0.0, fragmentation=0.0, in_place_reduce=True)  # gloo
    cluster = dataclasses.replace(cluster, memory=memory)
    return [{k: v for k, v in stage.items() if k != "reserved"} for stage in stage_memories(cfg, cluster)]


def run(names: list[str], steps: int) -> list[list[Any]]:
    # glibc returns a freed block to the system only if it was mmapped; with its default dynamic threshold
    # a freed activation raises the threshold and later ones stay in the heap, so the resident peak would
    # measure the allocator's history. A fixed threshold (read by every rank at start) keeps it honest.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    rows = []
    for name in names:
        world, layout = LAYOUTS[name]
        overrides = [*MODEL, *layout, f"--run.dir=/tmp/meshtron-memory-{name}"]
        stages = predicted(overrides, world)
        results = harness.run_world(world, measure, overrides, steps)
        for r in sorted((r for r in results if r["first"]), key=lambda r: r["pp_rank"]):
            stage = stages[r["pp_rank"]]
            want, got = sum(stage.values()), r["peak"] - r["fixed"]
            parts = ", ".join(f"{k} {v / MiB:.0f}" for k, v in stage.items() if v)
            rows.append([f"{name} (stage {r['pp_rank']})" if len(stages) > 1 else name, f"{r['fixed'] / MiB:.0f}",
                         f"{got / MiB:.0f}", f"{want / MiB:.0f}", f"{got / want:.3f}", parts])  # fmt: skip
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def report(rows: list[list[Any]], steps: int) -> str:
    header = (
        "layout | fixed overhead MiB | measured MiB (resident peak - fixed) | predicted MiB "
        "| measured / predicted | predicted parts (MiB)"
    )
    ratios = [float(r[4]) for r in rows]
    within = sum(abs(x - 1) <= 0.10 for x in ratios)
    return "\n".join(
        [
            f"Model: dim 512, 8 layers, 8 heads (4 KV), FFN 1536, vocabulary 8192, sequences of 512, global batch 8; "
            f"{steps} steps; CPU: {cpu_model()}; each rank's resident peak (ru_maxrss), the first rank of "
            "each stage's data-parallel and tensor-parallel groups. Reproduce: `python benchmarks/memory_vs_plan.py`.",
            "",
            f"Within ±10%: {within} of {len(rows)} (measured / predicted {min(ratios):.2f} to {max(ratios):.2f}).",
            "",
            *table(header, rows),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = run(args.only or list(LAYOUTS), args.steps)
    if args.out != "-":
        write_section(
            Path(args.out), "Memory: the planner against measured peaks", __file__, report(rows, args.steps)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
