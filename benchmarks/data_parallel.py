"""Benchmark: meshtron's data-parallel engines vs PyTorch's DDP and FSDP2, 4 gloo ranks on CPU (fp32).

One training step (forward, cross-entropy, backward, gradient sync, clipping to 1.0, AdamW, post-step
work, zero_grad) of the same Llama model on the same batches: meshtron DDP vs torch DDP, meshtron ZeRO-3
vs FSDP2 (`fully_shard` per block and on the root, through `TorchFSDP`), meshtron ZeRO-1 vs PyTorch's
`ZeroRedundancyOptimizer` around DDP, meshtron ZeRO-2 vs `fully_shard(reshard_after_forward=False)`, and
ZeRO-1/2 vs torch DDP. meshtron's engines are driven as the Trainer drives them. Also times the bare gloo
collectives on one buffer the size of the whole gradient: the floor under every engine's sync.
Method and analysis: benchmarks/RESULTS.md. E.g. `python benchmarks/data_parallel.py --steps 10 --out -`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Clock, Counter, Pair, Runner
from reporting import mib, ms, table
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import ModelConfig
from meshtron.engines.ddp import DistributedDataParallel
from meshtron.engines.engine import DataParallelEngine
from meshtron.engines.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel
from meshtron.engines.simple_fsdp import SimpleFSDP
from meshtron.engines.zero import ZeroShardedOptimizer
from meshtron.models.llama import build_model
from meshtron.observe.metrics import model_state_bytes, state_bytes
from meshtron.parallel.compile import compile_blocks
from meshtron.train.optim import build_optimizer, clip_grad_norm_

TITLE = "## Data parallel: meshtron vs PyTorch DDP and FSDP2 (4 gloo ranks, CPU)"
WORLD = 4
MAX_NORM = 1.0
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
NAMES = (
    "meshtron DDP",
    "torch DDP",
    "meshtron ZeRO-3",
    "torch FSDP2",
    "meshtron ZeRO-1",
    "torch ZeRO-1",
    "meshtron ZeRO-2",
    "torch FSDP2 no-reshard",
    "meshtron SimpleFSDP",
    "meshtron SimpleFSDP compiled",
    "torch FSDP2 compiled",
)
PAIRS = [Pair("meshtron DDP", "torch DDP"), Pair("meshtron ZeRO-3", "torch FSDP2")]
# Like for like: ZeroRedundancyOptimizer around DDP shards the optimizer state (ZeRO-1); fully_shard
# keeping the gathered parameters after forward shards gradients and state, not parameters (ZeRO-2).
PAIRS += [Pair("meshtron ZeRO-1", "torch ZeRO-1"), Pair("meshtron ZeRO-2", "torch FSDP2 no-reshard")]
PAIRS += [Pair(f"meshtron ZeRO-{stage}", "torch DDP") for stage in (1, 2)]  # against the unsharded floor
# SimpleFSDP (eager: a gather per parameter read, nothing bucketed) against the two hook-driven ZeRO-3s.
PAIRS += [Pair("meshtron SimpleFSDP", "torch FSDP2"), Pair("meshtron SimpleFSDP", "meshtron ZeRO-3")]
# Compiled blocks: the gathers in the graph, bucketed by inductor (one per block and pass).
PAIRS += [
    Pair("meshtron SimpleFSDP compiled", p)
    for p in ("meshtron SimpleFSDP", "torch FSDP2", "torch FSDP2 compiled")
]
MODEL = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096)
SEQ, BATCH_PER_RANK = 128, 2
TOKENS = WORLD * BATCH_PER_RANK * SEQ  # global tokens per step: every rank's loss is divided by it


# -- what runs on every rank --


class DataParallel(Runner):
    """One implementation on this rank, stepped as meshtron's Trainer steps an engine; the torch sides'
    hooks are the defaults below (their reductions run inside backward)."""

    def __init__(self, name: str, model: nn.Module, params: list[nn.Parameter], loss_scale: float = 1.0):
        self.name, self.model, self.loss_scale = name, model, loss_scale
        self.optimizer = build_optimizer(params, LR, BETAS, EPS, WEIGHT_DECAY)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], clock: Clock) -> float:
        inputs, targets = batch
        self.prepare()
        ce_sum = F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
        loss = ce_sum * (self.loss_scale / TOKENS)
        clock.lap("forward")
        phases = {"backward": loss.backward, "sync": lambda: self.sync(clock), "clip": self.clip}
        for phase, run in (
            phases | {"optimizer": self.optimizer.step, "after_step": self.after_step}
        ).items():
            run()
            clock.lap(phase)
        clock.snapshot(self)  # before zero_grad, which may free gradients
        self.zero_grad()
        clock.lap("zero_grad")
        mean_ce = (ce_sum.detach() / TOKENS).reshape(1)
        dist.all_reduce(mean_ce)
        return float(mean_ce)

    def prepare(self) -> None:
        pass

    def sync(self, clock: Clock) -> None:
        pass

    def clip(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM, foreach=True)

    def after_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self) -> dict[str, Any]:
        return {"state": state_bytes(self.model.parameters(), self.optimizer)}


class Ours(DataParallel):
    def __init__(self, name: str, engine: DataParallelEngine, comm: Comm):
        super().__init__(name, engine.model, engine.optimizer_params())
        self.engine, self.comm = engine, comm

    def prepare(self) -> None:
        self.engine.prepare_micro_batch(is_last=True)

    def sync(self, clock: Clock) -> None:
        self.engine.finish_gradients()

    def clip(self) -> None:
        clip_grad_norm_(self.engine, MAX_NORM, self.comm)

    def after_step(self) -> None:
        self.engine.after_step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def snapshot(self) -> dict[str, Any]:
        return {"state": model_state_bytes(self.engine, self.optimizer)}

    def counting(self) -> contextlib.AbstractContextManager[Counter | None]:
        return contextlib.nullcontext(harness.CommCounter(self.comm))


class TorchDDP(DataParallel):
    def __init__(self, model: nn.Module, group: Any, bucket_mb: float):
        # gradient_as_bucket_view: .grad is a view of the bucket, as in ours; zero_grad keeps the views.
        ddp = nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True
        )
        # DDP averages over its ranks; ours sum. Scaling the loss by the world size makes them equal.
        super().__init__("torch DDP", ddp, list(model.parameters()), float(WORLD))
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def sync(self, clock: Clock) -> None:
        # Its reducer all-reduced every gradient inside backward, from C++ where Python cannot see the
        # calls: in the measured step, count that volume from theory.
        if clock.counter is not None:
            clock.counter.add("all_reduce", self.grad_bytes, WORLD)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def counting(self) -> contextlib.AbstractContextManager[Counter | None]:
        return contextlib.nullcontext(Counter())


class TorchZero1(TorchDDP):
    """PyTorch's ZeRO-1: DDP all-reduces the gradients, `ZeroRedundancyOptimizer` steps each rank's
    share of the parameters (AdamW, the same decay groups as ours) and broadcasts them."""

    def __init__(self, model: nn.Module, group: Any, bucket_mb: float):
        super().__init__(model, group, bucket_mb)
        self.name = "torch ZeRO-1"
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]} for g in self.optimizer.param_groups
        ]
        self.optimizer = ZeroRedundancyOptimizer(
            groups, torch.optim.AdamW, process_group=group, lr=LR, betas=BETAS, eps=EPS, foreach=True
        )

    def sync(self, clock: Clock) -> None:
        # DDP's all-reduce inside backward, and the optimizer's broadcasts of each rank's updated
        # parameters (every parameter once, (n-1)/n of it leaving its owner): both from theory.
        super().sync(clock)
        if clock.counter is not None:
            clock.counter.add("broadcast", self.grad_bytes, WORLD)

    def snapshot(self) -> dict[str, Any]:
        return {"state": state_bytes(self.model.parameters(), self.optimizer.optim)}


class TorchFSDP2(DataParallel):
    def __init__(self, engine: TorchFSDP, name: str = "torch FSDP2"):
        super().__init__(name, engine.model, engine.optimizer_params())

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counter | None]:
        """FSDP2 calls `dist.all_gather_single` / `dist.reduce_scatter_single`, looked up at call time,
        so wrapping those two sees every one of its collectives (its grad-norm scalar is not counted)."""
        originals, counter = (dist.all_gather_single, dist.reduce_scatter_single), Counter()

        def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, **kw: Any) -> Any:
            counter.add("all_gather", output.numel() * output.element_size(), dist.get_world_size(group))
            return originals[0](output, input, group=group, **kw)

        def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kw: Any) -> Any:
            world = dist.get_world_size(kw.get("group"))
            counter.add("reduce_scatter", input.numel() * input.element_size(), world)
            return originals[1](output, input, *args, **kw)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
        try:
            yield counter
        finally:
            dist.all_gather_single, dist.reduce_scatter_single = originals


def build_runner(name: str, seed: int, bucket_mb: float, mesh: ParallelMesh) -> DataParallel:
    model, comm = build_model(MODEL, seed=seed), Comm()
    blocks = list(model.layers.values())
    settings = DataParallelSettings(bucket_bytes=int(bucket_mb * 2**20))
    groups = EngineGroups(
        comm=comm,
        shard=mesh.group("dp_shard"),
        replicate=mesh.group("dp_replicate"),
        shard_mesh=mesh.mesh("dp_shard"),
    )
    wrapped = EngineModel(model=model, blocks=blocks)
    if name == "torch DDP":
        return TorchDDP(model, mesh.group("dp").process_group, bucket_mb)
    if name == "torch ZeRO-1":
        return TorchZero1(model, mesh.group("dp").process_group, bucket_mb)
    if name.startswith("torch FSDP2"):
        if name.endswith("compiled"):  # each block's forward, as ours: FSDP2's hooks stay outside
            compile_blocks(model)
        fsdp2 = replace(settings, reshard_after_forward=name != "torch FSDP2 no-reshard")
        return TorchFSDP2(TorchFSDP(wrapped, groups, fsdp2), name)
    if name == "meshtron DDP":
        engine: DataParallelEngine = DistributedDataParallel(
            wrapped, replace(groups, replicate=mesh.group("dp")), settings
        )
    elif name.startswith("meshtron SimpleFSDP"):
        compiled = name.endswith("compiled")
        if compiled:
            compile_blocks(model, bucket_collectives=True)
        engine = SimpleFSDP(wrapped, groups, replace(settings, compiled=compiled))
    elif name == "meshtron ZeRO-3":
        engine = FullyShardedDataParallel(wrapped, groups, settings)
    else:
        engine = ZeroShardedOptimizer(wrapped, groups, replace(settings, zero=int(name[-1])))
    return Ours(name, engine, comm)


def collective_floor(numel: int, reps: int) -> dict[str, list[float]]:
    """Seconds of bare gloo collectives on one flat fp32 buffer the size of the whole gradient, taking
    turns as the engines do."""
    numel += -numel % WORLD
    full, shard = torch.randn(numel), torch.empty(numel // WORLD)
    ops = {
        "all-reduce": lambda: dist.all_reduce(full),
        "reduce-scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all-gather": lambda: dist.all_gather_single(full, shard),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)
    return times


def bench_rank(
    names: Sequence[str], seed: int, warmup: int, steps: int, bucket_mb: float, op_tables: bool
) -> harness.RankResult:
    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelDims(dp_shard=WORLD), "cpu")
    runners = [build_runner(name, seed, bucket_mb, mesh) for name in names]
    rows = slice(dist.get_rank() * BATCH_PER_RANK, (dist.get_rank() + 1) * BATCH_PER_RANK)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = harness.token_batch(MODEL.vocab_size, WORLD * BATCH_PER_RANK, SEQ, seed, step)
        return inputs[rows], targets[rows]

    result = harness.run_rounds(runners, batch_of, pairs_of(names), warmup, steps, op_tables=op_tables)
    n_params = sum(p.numel() for p in build_model(MODEL, seed).parameters())
    result.extra = {"n_params": n_params, "floor": collective_floor(n_params, max(5, steps // 2))}
    return result


def pairs_of(names: Sequence[str]) -> list[Pair]:
    return [p for p in PAIRS if p.ours in names and p.peer in names]


# -- what the parent makes of the ranks' results --


def tables(results: list[harness.RankResult], report: reporting.Report) -> list[list[str]]:
    pairs, samples, runs = report.pairs, report.samples, report.samples.values()
    theory = ("torch DDP", "torch ZeRO-1")
    comm = {s.name: mib(s.comm()[1]) + (" (theory)" if s.name in theory else "") for s in runs}
    phases = ("forward", "backward", "sync", "clip", "optimizer", "after_step", "zero_grad")
    floors = [r.extra["floor"] for r in results]
    floor = {op: statistics.median(map(max, zip(*(f[op] for f in floors), strict=True))) for op in floors[0]}
    faults = {s.name: f"{statistics.median(s.faults):,.0f}" for s in runs}
    groups = {"forward": ["forward"], "backward + sync": ["backward", "sync"]} | {p: [p] for p in phases[3:]}
    return [
        reporting.comparison_table(pairs, samples),
        table(
            "implementation | median step ms | p10 ms | p90 ms | state MiB per rank (params / grads / optim) "
            "| peak step allocations MiB | comm MiB per step per rank | collectives per step, rank 0",
            [
                [
                    s.name,
                    *s.timing(),
                    s.state,
                    mib(s.alloc_peak),
                    comm[s.name],
                    str(s.measured[0].collectives),
                ]
                for s in runs
            ],
            "Steps (the slowest rank's); state after the optimizer step (the largest rank's), peak "
            "allocations, per-rank ring volume and collectives issued (`c10d::` operator calls under the "
            "profiler, however issued: eager, DTensor or a compiled graph), of the measured step:",
        ),
        table(
            f"implementation | {' | '.join(phases)} | minor page faults per step",
            [[s.name, *(ms(s.phase(p)) for p in phases), faults[s.name]] for s in runs],
            "Median ms per phase (mean over ranks; torch DDP and FSDP2 wait for their reductions inside "
            "`backward`, ours in `sync`; ZeRO-1/2 all-gather the updated parameters in `after_step`):",
        ),
        reporting.delta_table(pairs, samples, groups),
        table(
            " | ".join(floor),
            [[ms(t) for t in floor.values()]],
            "Bare gloo collectives on one flat fp32 buffer the size of the whole gradient (slowest rank, "
            "median ms):",
        ),
    ]


# `meshtron train` end to end: the demo on 4 ranks under each engine (issue 34.5's method).
END_TO_END = {"DDP": 4, "ZeRO-1": 1, "ZeRO-2": 2}  # name -> dp_replicate 4 (DDP), or the ZeRO stage


def end_to_end(rounds: int, steps: int = 25, skip: int = 5) -> list[list[str]]:
    """Each engine's median step time of `meshtron train --config configs/demo.toml --nproc 4` (steps
    skip+1..steps), the engines alternating for `rounds` rounds, every run's first loss equal to DDP's."""
    from planner_cpu import Case, run_case

    from meshtron.plan.layout import Layout

    times: dict[str, list[float]] = {name: [] for name in END_TO_END}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            first = {}
            for name, value in END_TO_END.items():
                layout = ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"] if name == "DDP" else [
                    "--parallel.dp_shard=4", f"--parallel.zero={value}"]  # fmt: skip
                flags = [f"--training.steps={steps}", "--training.global_batch=8", "--training.micro_batch=2",
                         "--run.plot=false", "--run.log_every=1", *layout]  # fmt: skip
                rows, _ = run_case(
                    Case(name, "configs/demo.toml", Layout()), flags, steps, Path(tmp) / f"{name}-{index}"
                )
                first[name] = rows[0]["loss"]
                times[name].append(statistics.median(r["step_time_s"] for r in rows[skip:]))
            if any(abs(loss - first["DDP"]) > 1e-4 * abs(first["DDP"]) for loss in first.values()):
                sys.exit(f"end to end: first losses differ ({first}): nothing compared")
    ddp = statistics.median(times["DDP"])
    rows = [
        [name, " / ".join(ms(t) for t in ts), f"{statistics.median(ts) / ddp:.2f}"]
        for name, ts in times.items()
    ]
    return table(
        "engine | median step ms per round | median over rounds vs DDP",
        rows,
        f"`meshtron train --config configs/demo.toml --nproc 4`, global batch 8, micro-batch 2, steps "
        f"{skip + 1}-{steps} of each run, the engines alternating over {rounds} rounds:",
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__)
    parser.add_argument(
        "--bucket-mb", type=float, default=25.0, help="DDP / ZeRO-1/2 bucket size, both sides"
    )
    parser.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help="a subset (quote names)")
    parser.add_argument(
        "--end-to-end-rounds", type=int, default=2, help="rounds of `meshtron train` runs (0: none)"
    )
    args = parser.parse_args(argv)
    report, names = reporting.Report(__file__, TITLE), args.only or list(NAMES)
    results = harness.run_world(
        WORLD, bench_rank, names, args.seed, args.warmup, args.steps, args.bucket_mb, args.profile
    )
    report.add(results)
    report.blocks = tables(results, report)
    if args.end_to_end_rounds:
        report.blocks.append(end_to_end(args.end_to_end_rounds))
    rss = max(r.max_rss for r in results) / 2**20
    report.facts = [
        f"{WORLD} ranks x `torch.set_num_threads(1)` on {os.cpu_count()} cores: oversubscribed, so every "
        "collective also waits for the OS to schedule its peers, and absolute times are noisy",
        f"model: {reporting.model_text(MODEL)}, seq {SEQ}, {BATCH_PER_RANK} sequences per rank "
        f"({WORLD * BATCH_PER_RANK} global); {results[0].extra['n_params'] / 1e6:.2f}M parameters, fp32; "
        f"bucket {args.bucket_mb:g} MiB (DDP and ZeRO-1/2, both sides)",
        f"{args.steps} timed steps per implementation after the check step and {args.warmup} warmup, plus "
        f"one measured step; peak RSS per rank (all implementations live in each rank): {rss:.0f} MiB",
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
