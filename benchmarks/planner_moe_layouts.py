"""The planner against five layouts of one MoE model measured on one cluster: does it rank them as they ran?

Megatron-Core's MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md,
"Performance Results, H100") trained Qwen3-235B-A22B on the same 256 H100s (NVLink 4, InfiniBand 8 x 50
GB/s per node), BF16, sequences of 4,096, batch 2,048, in a cross-node expert-parallel layout and in
intra-node ones, and published each step time. Each row here is planned with its published degrees and
settings in meshtron's terms:

  published                       meshtron
  DeepEP dispatcher               parallel.ep_dispatch=hierarchical, --overlap ... ep_hops (DeepEP
                                  forwards over NVLink what arrives over the network)
  A2A dispatcher                  parallel.ep_dispatch=alltoall
  "+1f1b overlap"                 --overlap ... ep (the all-to-alls behind the other micro-batch)
  recompute norm, act             training.recompute=op (op_recompute_saves=matmuls: norms and
                                  activations rerun, matmul outputs kept)
  recompute full                  training.recompute=full
  FSDP on                         parallel.zero=3
  distributed optimizer           parallel.zero=1
  embedding and loss each         parallel.pp_embedding_layers=1, pp_head_layers=1 (94 layers + 2 over
  counted as a layer               pp*vpp = 32 chunks: 3 each)

Run: python benchmarks/planner_moe_layouts.py [--out -]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner_vs_published import QWEN3_235B
from reporting import RESULTS, write_section

from meshtron.plan.comm_time import Overlap
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.hardware import accelerator
from meshtron.plan.search import search
from meshtron.rules.checks import load_config

MEGATRON = "dp_reduce,dp_gather,fsdp_prefetch,tp,cp,pp"
SOURCE = "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100 table)"
PIPELINE = dict(pp_schedule="interleaved", pp_embedding_layers=1, pp_head_layers=1)


@dataclass(frozen=True)
class Measured:
    name: str
    parallel: dict[str, Any]
    micro_batch: int
    recompute: str
    overlap: str
    step_s: float  # published


def zoo_rows() -> list[Measured]:
    deepep = f"{MEGATRON},ep_hops"
    cross = dict(tp=2, sp="true", ep=32, etp=1, pp=8, vpp=4, dp_shard=16, zero=1, ep_dispatch="hierarchical")
    return [
        Measured("cross-node ep, DeepEP", {**cross, **PIPELINE}, 1, "op", deepep, 19.7),
        Measured("cross-node ep, DeepEP, 1F1B A2A overlap", {**cross, **PIPELINE}, 1, "op", f"{deepep},ep", 17.6),
        Measured("intra-node ep, FSDP, DeepEP", dict(tp=2, sp="true", ep=8, etp=1, dp_shard=128, zero=3,
                 ep_dispatch="hierarchical"), 4, "full", deepep, 17.6),
        Measured("intra-node ep, pp 32 x vpp 3, A2A", dict(tp=2, sp="true", ep=8, etp=1, pp=32, vpp=3,
                 dp_shard=4, zero=1, ep_dispatch="alltoall", **PIPELINE), 1, "op", MEGATRON, 24.2),
        Measured("intra-node ep, tp 4, DeepEP", dict(tp=4, sp="true", ep=8, etp=1, pp=8, vpp=4, dp_shard=8,
                 zero=1, ep_dispatch="hierarchical", **PIPELINE), 1, "none", deepep, 29.0),
    ]  # fmt: skip


def config_of(row: Measured):
    overrides = [f"--model.{k}={v}" for k, v in QWEN3_235B.items()]
    overrides += ["--training.seq_len=4096", "--training.global_batch=2048", "--training.dtype=bf16"]
    overrides += [f"--training.micro_batch={row.micro_batch}", f"--training.recompute={row.recompute}"]
    overrides += [f"--parallel.{k}={v}" for k, v in row.parallel.items()]
    return load_config(None, overrides)


def plan_row(row: Measured) -> dict[str, Any]:
    cluster = Cluster(accelerator("h100"), 256, "bf16", overlap=Overlap.parse(row.overlap))
    try:
        est = estimate(config_of(row), cluster)
    except ValueError as error:  # a layout meshtron cannot write
        return dict(row=row, refused=str(error))
    return dict(row=row, est=est, error=est.step_time_s / row.step_s - 1)


def layer_microbatches(row: Measured) -> float:
    """The layer passes (forward and backward of one layer on one micro-batch) a rank runs per step: its
    micro-batches times its layers (94 over pp stages: a fraction where they do not divide)."""
    cfg = config_of(row)
    p, t = cfg.parallel, cfg.training
    return t.global_batch / (p.dp_shard * p.dp_replicate * t.micro_batch) * cfg.model.n_layers / p.pp


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    return [order.index(i) + 1 for i in range(len(values))]


def table(planned: list[dict[str, Any]]) -> list[str]:
    timed = [p for p in planned if "est" in p]
    measured_rank = dict(zip(map(id, timed), _ranks([p["row"].step_s for p in timed]), strict=True))
    predicted_rank = dict(zip(map(id, timed), _ranks([p["est"].step_time_s for p in timed]), strict=True))
    lines = [
        "| layout (published) | meshtron's keys | --overlap | published step s | predicted step s | error | "
        "rank published / predicted | predicted parts (s) | ms per layer and micro-batch: published / "
        "predicted compute | memory GiB (fits 80) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in planned:
        row = p["row"]
        keys = ",".join(
            f"{k}={v}" for k, v in row.parallel.items() if k not in PIPELINE or k == "pp_schedule"
        )
        keys += f",micro_batch={row.micro_batch},recompute={row.recompute}"
        head = f"| {row.name} | {keys} | {row.overlap} | {row.step_s:.1f} |"
        if "refused" in p:
            lines.append(f"{head} refused: {p['refused']} | | | | | |")
            continue
        est = p["est"]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in est.time.items() if v >= 0.05)
        memory = est.memory_bytes_per_gpu / 2**30
        passes = layer_microbatches(row)
        lines.append(
            f"{head} {est.step_time_s:.1f} | {100 * p['error']:+.0f}% | {measured_rank[id(p)]} / "
            f"{predicted_rank[id(p)]} | {parts} | {1e3 * row.step_s / passes:.1f} / "
            f"{1e3 * est.time['compute'] / passes:.1f} | {memory:.0f} ({'yes' if est.fits else 'no'}) |"
        )
    return lines


def searched_best() -> str:
    """The planner's own best layout for this model and cluster, as meshtron would run it."""
    row = zoo_rows()[0]
    base = config_of(Measured(row.name, dict(ep_dispatch="hierarchical"), 1, "op", MEGATRON, 0.0))
    plan = search(base, Cluster(accelerator("h100"), 256, "bf16"), {}, top=1)
    if not plan.ranked:
        return "nothing fits"
    layout, est = plan.ranked[0]
    return (
        f"{layout.describe()}: {est.step_time_s:.1f} s predicted, {est.memory_bytes_per_gpu / 2**30:.0f} GiB"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    started = time.time()
    planned = [plan_row(row) for row in zoo_rows()]
    lines = table(planned)
    best = searched_best()
    facts = [
        f"- date: {datetime.date.today()}; {time.time() - started:.0f} s; reproduce: "
        "`python benchmarks/planner_moe_layouts.py`",
        f"- source: {SOURCE}; Qwen3-235B-A22B, 256 H100, BF16, seq 4096, batch 2048",
        f"- the planner's own best for meshtron (its default overlap, hierarchical dispatch, recompute op): {best}",
    ]
    body = "\n".join([*facts, "", *lines]) + "\n"
    print(body)
    if args.out != "-":
        write_section(
            Path(args.out),
            "## Planner against one MoE model's measured layouts",
            "planner_moe_layouts.py",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
