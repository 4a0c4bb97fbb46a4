"""Benchmark: DualPipeV with its F&B pairs overlapped (`parallel.pp_overlap=on`: a pair's forward in a
second thread on twin process groups while its backward runs) against the same schedule one action at a
time, and against 1F1B, on an MoE model with its experts over ep=2 inside each of pp=2 stages (4 gloo
ranks on CPU, fp32, ZeRO-1 over the two data-parallel ranks of each stage).

Every layout runs the full training step of `meshtron train` (Trainer.step) on the same batches. Before
anything is timed the check steps' losses must agree, and the two dualpipev runs' gradients (1F1B's
stages hold other layers); after them the learning rate is 0
(AdamW still runs), so the losses of every later step must agree too (1F1B sums the micro-batches'
gradients in another order, and a few steps of training would flip a near-tied top-k assignment).
Reported per layout: step time, the measured bubble (the share of the step a rank spent not computing,
concurrent actions counted once), and, for the pairs, how long their forwards waited in expert
all-to-alls and how much of that the other micro-batch's backward spent computing (pipeline/pairs.py
`hidden_exchanges`). PyTorch's `ScheduleDualPipeV` runs its OVERLAP_F_B actions as a forward then a
backward unless a custom overlap function is registered, and `torch.distributed.pipelining` has no MoE
token exchange, so the peer here is our own schedule without the overlap.
E.g. `python benchmarks/pipeline_pairs.py --out benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
from harness import Clock, Pair, Runner
from reporting import ms, table

from meshtron.comm.mesh import ParallelMesh
from meshtron.config.schema import Config
from meshtron.pipeline.pairs import hidden_exchanges
from meshtron.rules.checks import load_config
from meshtron.train.trainer import Trainer

TITLE = "## DualPipeV pairs overlapped: MoE all-to-alls behind the other micro-batch (pp 2 x ep 2, 4 gloo ranks, CPU)"
WORLD = 4
MODEL = [
    *harness.MOE_MODEL,
    "--training.global_batch=16",
    "--training.micro_batch=1",
    "--training.warmup_steps=2",
    "--training.steps=1000",
    "--run.plot=false",
    "--parallel.pp=2",
    "--parallel.dp_shard=2",
    "--parallel.ep=2",
    "--parallel.zero=1",
]
DUALPIPEV = ["--parallel.pp_schedule=dualpipev", "--parallel.vpp=2"]
OVERLAPPED, ONE_BY_ONE, ONE_F_ONE_B = "dualpipev, pairs overlapped", "dualpipev, one at a time", "1f1b"
LAYOUTS = {
    OVERLAPPED: [*DUALPIPEV, "--parallel.pp_overlap=true"],
    ONE_BY_ONE: [*DUALPIPEV, "--parallel.pp_overlap=false"],
    ONE_F_ONE_B: ["--parallel.pp_schedule=1f1b"],
}
PAIRS = [Pair(OVERLAPPED, ONE_BY_ONE), Pair(OVERLAPPED, ONE_F_ONE_B), Pair(ONE_BY_ONE, ONE_F_ONE_B)]


def config(name: str, run_dir: str) -> Config:
    slug = name.replace(", ", "-").replace(" ", "-")
    return load_config(None, [*MODEL, *LAYOUTS[name], f"--run.dir={run_dir}/{slug}"])


class TrainerStep(Runner):
    """meshtron's training step for one layout; keeps the check steps' gradients for the parity check and
    notes each step's bubble and the pairs' all-to-all waits."""

    def __init__(self, name: str, cfg: Config):
        dims = cfg.parallel.dims(dist.get_world_size())
        self.name, self.trainer, self.step_index = name, Trainer(cfg, ParallelMesh(dims, "cpu")), 0
        self.keep_grads, self.kept = True, None
        engine = self.trainer.engine
        zero_grad = engine.zero_grad

        def zero_grad_after_looking() -> None:
            if self.keep_grads:
                self.kept = engine.full_gradients(self.trainer.comm)
            zero_grad()

        engine.zero_grad = zero_grad_after_looking

    def freeze(self) -> None:
        """The learning rate is 0 from now on (the module docstring says why)."""
        self.keep_grads, self.kept = False, None
        harness.freeze_at_zero_lr(self.trainer.optimizer)

    def step(self, batch: Any, clock: Clock) -> float:
        start = time.perf_counter()
        row = self.trainer.step(self.step_index)
        clock.lap("step")
        runtime = self.trainer.parallel.pipeline
        waited, _, hidden = hidden_exchanges(runtime.timeline, runtime.comm_timeline)
        clock.notes.update(
            step_s=time.perf_counter() - start, bubble=runtime.idle_fraction(), waited=waited, hidden=hidden
        )
        self.step_index += 1
        return row["loss"]

    def grads(self) -> dict[str, torch.Tensor] | None:
        # 1F1B's stages hold other layers than the V's chunks: its pairs compare losses only.
        return None if self.name == ONE_F_ONE_B else self.kept


def bench_rank(names: Sequence[str], warmup: int, steps: int, check_steps: int) -> harness.RankResult:
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="meshtron-bench-pairs-")
    runners = [TrainerStep(name, config(name, run_dir)) for name in names]

    def batch_of(i: int) -> None:  # each trainer draws its own batches; after the checks: frozen weights
        if i == check_steps:
            for r in runners:
                r.freeze()

    return harness.run_rounds(runners, batch_of, PAIRS, warmup, steps, check_steps=check_steps, measure=False)


def _mean_note(s: reporting.Samples, key: str) -> float:
    """The mean over ranks and timed steps of a step note."""
    return statistics.fmean(n[key] for rank in s.notes for n in rank)


def tables(samples: dict[str, reporting.Samples]) -> list[list[str]]:
    base = samples[ONE_BY_ONE]
    rows = []
    for name, s in samples.items():
        waited, hidden = _mean_note(s, "waited"), _mean_note(s, "hidden")
        rows.append(
            [
                name,
                *s.timing(),
                f"{s.median / base.median:.3f}",
                f"{100 * _mean_note(s, 'bubble'):.1f}%",
                ms(waited) if waited else "-",
                f"{ms(hidden)} ({100 * hidden / waited:.0f}%)" if waited else "-",
            ]
        )
    header = (
        "layout | step median (ms) | p10 | p90 | vs one at a time | measured bubble "
        "| pairs' forwards in all-to-alls (ms per rank-step) | of which the other micro-batch computed"
    )
    return [table(header, rows), reporting.comparison_table(PAIRS, samples)]


def main(argv: Sequence[str] | None = None) -> None:
    names = list(LAYOUTS)
    args, results = reporting.run_named_layouts(__doc__, WORLD, bench_rank, names, argv)
    report = reporting.Report(__file__, TITLE)
    samples = report.add(results)
    report.blocks += tables(samples)
    cfg = config(ONE_BY_ONE, ".")
    m, t = cfg.model, cfg.training
    cpus = os.cpu_count() or 1
    report.facts = [
        f"every rank `torch.set_num_threads(1)`; {WORLD} ranks (and the pairs' helper threads) on {cpus} "
        "logical CPUs"
        + (" (oversubscribed: overlap can hide waiting, not add cores)" if cpus < WORLD else ""),
        f"model: {reporting.model_text(m)}, {m.n_experts} experts (ffn {m.expert_ffn_dim}), top-{m.top_k}, every "
        f"layer MoE; pp=2 (dualpipev: 4 chunks of 1 layer in a V; 1f1b: 2 stages of 2), ep=2 in each stage, "
        f"ZeRO-1 over dp=2",
        f"seq {t.seq_len}, {t.global_batch} sequences per step, micro-batch {t.micro_batch}: "
        f"{t.global_batch // (t.micro_batch * 2)} micro-batches per pipeline; fp32",
        f"{args.steps} timed steps per layout after {args.check_steps} check steps and {args.warmup} warmup; "
        "learning rate 0 after the check steps, so every later loss is checked too",
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
