"""The planner against one publisher's runs across its releases: Megatron Bridge's performance summary
(a page of NVIDIA-NeMo/Megatron-Bridge's documentation), which reprints the same model, GPUs and layout
for each NeMo container, measured again with that release's software.

It asks two things planner_vs_published.py cannot: how far apart a publisher's own figures for one
layout are from release to release (the spread any ±15% bar sits inside), and how the planner does on
runs it was never compared with: DGX-B200 rows (the planner's B200 matmul share is Hopper's, unverified
elsewhere) and MoE layouts other than the ones planner_vs_published.py holds.

Every row is as the table prints it: model, GPU count, global and micro-batch, sequence length, tp, pp,
cp, vpp, ep, FP8 (current scaling on H100, and on B200 where the table says FP8-CS; FP8-MX rows are
planned with the same FP8 costs). The table prints no recompute: each row is planned without any, as
the speed of that layout, whatever meshtron's memory says; beside it, the memory meshtron would need
for it per GPU (meshtron keeps more than Megatron-Core: fp32 weights and gradients on every rank of a
stage, activations in bf16 where Transformer Engine keeps FP8 copies), so where it does not fit,
meshtron itself would run it with recompute and slower. Unstated settings (schedule details, where
the head sits) are the planner's. MoE rows take DeepEP's two hops and no all-to-all overlap: the
releases' recipes are not read here. H100 and B200 only (GB200 and GB300 have NVLink domains of 72
GPUs, which the planner's table does not hold). Nothing here calibrates the planner.

Reproduce: `python benchmarks/planner_vs_releases.py` (about a minute).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner_vs_published import (
    MEGATRON,
    MEGATRON_DEEPEP,
    QWEN3_30B,
    QWEN3_235B,
    TWO_HOPS,
    Run,
    base_config,
    cluster_for,
)
from reporting import RESULTS, write_section

from meshtron.plan.search import search

SUMMARY = "Megatron Bridge performance summary"
RELEASES = ("25.09", "25.11")


@dataclass(frozen=True)
class Row:
    """One model, GPU count and layout of the summary, with its published tokens/s per GPU by release."""

    model_name: str
    model: dict[str, Any]
    gpu: str
    gpus: int
    seq_len: int
    global_batch: int
    layout: dict[str, Any]
    published: dict[str, float]  # release -> tokens/s per GPU
    notes: str = ""
    moe: bool = False

    def run(self) -> Run:
        overlap, settings = (MEGATRON_DEEPEP, TWO_HOPS) if self.moe else (MEGATRON, ())
        rate = next(iter(self.published.values()))
        return Run(
            f"{self.model_name} {self.gpus} x {self.gpu}", SUMMARY, self.gpu, self.gpus, self.model,
            self.seq_len, self.global_batch, {"cp": 1, "recompute": "none", **self.layout}, rate, overlap, dtype="fp8",
            settings=settings,
        )  # fmt: skip


L8, L70, L405, DSV3 = (dict(name=n) for n in ("llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3"))


def rows() -> list[Row]:
    """The DGX-H100 and DGX-B200 rows of the 25.09 and 25.11 containers. 25.09 prints no precision
    column: its parenthesised MX figures say the plain ones are FP8 with current scaling. MoE rows
    marked "tokendrop" there are planned as dropless (routing forced to balance fills each expert's
    capacity exactly). The 25.11 H100 Qwen3-235B row lacks a column (its global batch is unknown): not
    used."""
    interleaved = dict(pp_schedule="interleaved")
    return [
        Row("Llama 3 8B", L8, "h100", 8, 8192, 128, dict(tp=1, pp=1, dp_shard=8, zero=3, micro_batch=1),
            {"25.09": 14079, "25.11": 14451}),
        Row("Llama 3 70B", L70, "h100", 64, 8192, 128, dict(tp=4, sp=True, pp=8, vpp=5, **interleaved, dp_shard=2,
            zero=1, micro_batch=1), {"25.09": 1619, "25.11": 1602}),
        Row("Llama 3.1 405B", L405, "h100", 1024, 8192, 512, dict(tp=8, sp=True, pp=8, vpp=8, **interleaved,
            cp=2, dp_shard=8, zero=1, micro_batch=1), {"25.09": 302, "25.11": 292}),
        Row("Qwen3-30B-A3B", QWEN3_30B, "h100", 16, 4096, 512, dict(tp=1, pp=2, vpp=24, **interleaved, ep=8,
            dp_shard=8, zero=1, micro_batch=2), {"25.09": 10494, "25.11": 5275}, moe=True),
        Row("Qwen3-235B-A22B", QWEN3_235B, "h100", 256, 4096, 2048, dict(tp=2, sp=True, pp=8, vpp=4,
            **interleaved, ep=32, etp=1, dp_shard=16, zero=1, micro_batch=1), {"25.09": 1204}, moe=True),
        Row("Llama 3 8B", L8, "b200", 8, 8192, 128, dict(tp=1, pp=1, dp_shard=8, zero=1, micro_batch=2),
            {"25.09": 29994, "25.11": 30624}),
        Row("Llama 3.1 405B", L405, "b200", 128, 8192, 64, dict(tp=4, sp=True, pp=8, vpp=8, **interleaved,
            cp=2, dp_shard=2, zero=1, micro_batch=1), {"25.09": 664, "25.11": 661}),
        Row("DeepSeek-V3", DSV3, "b200", 256, 4096, 2048, dict(tp=1, pp=16, pp_schedule="1f1b", ep=8, dp_shard=16, zero=1,
            micro_batch=1), {"25.09": 2265, "25.11": 2139}, "25.11: FP8-MX", moe=True),
        Row("Qwen3-30B-A3B", QWEN3_30B, "b200", 8, 4096, 512, dict(tp=1, pp=1, ep=8, dp_shard=8, zero=1,
            micro_batch=1), {"25.09": 18066, "25.11": 9299}, "25.11: FP8-MX", moe=True),
        Row("Qwen3-235B-A22B", QWEN3_235B, "b200", 64, 4096, 1024, dict(tp=1, pp=8, vpp=2, **interleaved,
            ep=8, dp_shard=8, zero=1, micro_batch=1), {"25.09": 4104, "25.11": 3269}, "25.11: FP8-MX",
            moe=True),
    ]  # fmt: skip


HEADER = (
    "| model | GPUs | layout (+ planner's unstated keys) | "
    + " | ".join(f"{r} tok/s/GPU" for r in RELEASES)
    + " | releases' spread | predicted | error vs each release | meshtron's memory per GPU |\n|"
    + "---|" * (7 + len(RELEASES))
)


def line(row: Row, layout: Any, predicted: float, memory: float, capacity: float) -> str:
    rates = [row.published.get(r) for r in RELEASES]
    shown = [f"{x:,.0f}" if x else "-" for x in rates]
    known = [x for x in rates if x]
    spread = f"{max(known) / min(known):.2f}x" if len(known) > 1 else "-"
    errors = " / ".join(f"{100 * (predicted / x - 1):+.0f}%" if x else "-" for x in rates)
    kind = "MoE" if row.moe else "dense"
    note = f" ({row.notes})" if row.notes else ""
    return (
        f"| {row.model_name} ({kind}){note} | {row.gpus} x {row.gpu} fp8 | {layout.describe()} | "
        f"{' | '.join(shown)} | {spread} | {predicted:,.0f} | {errors} | {memory / 2**30:.0f} of {capacity / 2**30:.0f} GiB |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    started, lines, errors = time.time(), [], {"dense": [], "MoE": []}
    print(HEADER)
    for row in rows():
        run = row.run()
        found = search(base_config(run), cluster_for(run, None, ignore_memory=True), run.layout, top=1).ranked
        if not found:
            raise SystemExit(f"{run.name}: the published layout breaks a rule")
        layout, est = found[0]
        capacity = cluster_for(run, None).gpu.memory_bytes
        lines.append(line(row, layout, est.tokens_per_sec_per_gpu, est.memory_bytes_per_gpu, capacity))
        for rate in row.published.values():
            errors["MoE" if row.moe else "dense"].append(est.tokens_per_sec_per_gpu / rate - 1)
        print(lines[-1], flush=True)
    facts = [
        f"- date: {datetime.date.today()}; {len(lines)} layouts in {time.time() - started:.0f} s",
        "- reproduce: `python benchmarks/planner_vs_releases.py`",
    ] + [
        f"- {kind}: {sum(abs(e) <= 0.15 for e in errs)} of {len(errs)} published figures within ±15% "
        f"(errors {min(errs):+.0%} to {max(errs):+.0%})"
        for kind, errs in errors.items()
    ]
    print("\n".join(facts))
    if args.out != "-":
        body = "\n".join([*facts, "", HEADER, *lines]) + "\n"
        write_section(
            Path(args.out), "## Planner against one publisher's releases", "planner_vs_releases.py", body
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
