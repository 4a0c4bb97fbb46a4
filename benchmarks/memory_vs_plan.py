"""The planner's memory per rank against each rank's measured peak on this CPU.

For every layout, a fresh gloo world trains a few steps of a mid-sized model (30M parameters, sequences
of 512: model state and activations of a few hundred MB, well above the noise), and each rank reports
its fixed overhead, its measured peak and the planner's prediction (params, grads, optimizer, the
activations its schedule holds, the step's transients, the engine's buffers), as
meshtron/testing/peak_memory.py defines them, and the ratio measured / predicted. The planner's activation model counts the tensors each layer keeps
for backward (tests/test_activation_memory.py checks it tensor by tensor); what a step holds for a moment
(the loss's gradients, a recomputed layer, AdamW's temporary) and the engines' buffers are modelled too;
what is left is what this benchmark measures.

Usage: python benchmarks/memory_vs_plan.py [--only NAME ...] [--steps N] [--out RESULTS.md | -]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import harness
from reporting import RESULTS, cpu_model, table, write_section

from meshtron.testing.peak_memory import FIXED_MMAP_THRESHOLD, MID_MODEL, measure_peak, predicted_stages

MiB = 2**20
MODEL = MID_MODEL
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=768"]
PP = ["--parallel.pp=2", "--training.micro_batch=1"]
FINE_MOE = [
    "--model.n_experts=16",
    "--model.top_k=4",
    "--model.moe_ffn_dim=192",
    "--model.n_shared_experts=1",
]
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
    # fine-grained MoE (16 experts of 192, top-4, a shared expert) under ep x pp x ZeRO and folded
    "fine_moe_ep2_x_pp2_zero1": (4, [*FINE_MOE, *PP, "--parallel.ep=2", "--parallel.zero=1"]),
    "fine_moe_ep4_dedup_zero2": (
        4,
        [
            *FINE_MOE,
            "--parallel.ep=4",
            "--parallel.ep_dispatch=dedup",
            "--parallel.zero=2",
            "--training.micro_batch=1",
        ],
    ),
    "fine_moe_ep4_over_tp2_sp_zero3": (
        4,
        [
            *FINE_MOE,
            "--parallel.tp=2",
            "--parallel.sp=true",
            "--parallel.ep=4",
            "--parallel.etp=1",
            "--parallel.zero=3",
        ],
    ),
    # two experts over ZeRO-3's four ranks: each rank holds half of one expert's matrices (unpadded)
    "moe2_zero3_4_experts_cut_within": (
        4,
        ["--model.n_experts=2", "--model.top_k=2", "--model.moe_ffn_dim=768", "--training.micro_batch=1"],
    ),
    "fine_moe_ep4_hierarchical_zero1": (
        4,
        [
            *FINE_MOE,
            "--parallel.ep=4",
            "--parallel.ep_dispatch=hierarchical",
            "--run.gpus_per_node=2",
            "--parallel.zero=1",
            "--training.micro_batch=1",
        ],
    ),
}


def run(layouts: dict[str, tuple[int, list[str]]], steps: int) -> list[list[Any]]:
    """Each named (ranks, overrides) world trained `steps` steps: a row per stage (its data-parallel and
    tensor-parallel group's first rank), measured against predicted."""
    for key, value in FIXED_MMAP_THRESHOLD.items():  # read by every rank at its start
        os.environ.setdefault(key, value)
    rows = []
    for name, (world, layout) in layouts.items():
        overrides = [*layout, f"--run.dir=/tmp/meshtron-memory-{name}"]
        stages = predicted_stages(overrides, world)
        results = harness.run_world(world, measure_peak, overrides, steps)
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
            f"{steps} steps; CPU: {cpu_model()}; each rank's resident peak (VmHWM), the first rank of "
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
    rows = run(
        {name: (LAYOUTS[name][0], [*MODEL, *LAYOUTS[name][1]]) for name in args.only or LAYOUTS}, args.steps
    )
    if args.out != "-":
        write_section(
            Path(args.out),
            "## Memory: the planner against measured peaks",
            "memory_vs_plan.py",
            report(rows, args.steps),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
