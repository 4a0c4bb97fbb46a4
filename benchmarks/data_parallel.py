"""Benchmark: meshtron's data-parallel engines vs PyTorch's DDP and FSDP2, 4 gloo ranks on CPU (fp32).

What is measured: the wall time of one training step -- forward, cross-entropy loss, backward, gradient
synchronisation, global-norm clipping (max norm 1.0) and an `AdamW(foreach=True)` step (plus the
engine's post-step work and zero_grad) -- of the same Llama model on the same token batches, for

  * meshtron `DistributedDataParallel`          vs `torch.nn.parallel.DistributedDataParallel`
  * meshtron `FullyShardedDataParallel` (ZeRO-3) vs PyTorch FSDP2 (`fully_shard` on every block and
    the root, through meshtron's `TorchFSDP` wrapper)
  * meshtron `ZeroShardedOptimizer` stages 1 and 2, for context (compared with torch DDP).

How:
  * one 4-rank gloo world (`meshtron.testing.workers.WorkerPool`), one thread per rank; every implementation
    lives in every rank at once, each with its own copy of the model built by `build_model(cfg, seed)`
    and its own optimizer (`build_optimizer`: AdamW, weight decay on matrices only);
  * the token batches are random, drawn from (seed, step), so every implementation sees the same
    global batch at its n-th step; each rank takes its slice;
  * the math is the same everywhere: meshtron's engines sum gradients over ranks and every rank's loss
    is its cross-entropy sum / global token count. Torch DDP averages gradients over its 4 ranks, so
    its loss is multiplied by the world size (4 and the token count are powers of two: the scaling is
    exact). FSDP2 is told to sum (`set_gradient_divide_factor(1.0)`,
    `set_force_sum_reduction_for_comms(True)`, as `TorchFSDP` does). Torch sides clip with
    `torch.nn.utils.clip_grad_norm_`, ours with `meshtron.train.optim.clip_grad_norm_`;
  * correctness while timing: the global mean loss of every step must match between each meshtron
    engine and its torch counterpart to `LOSS_RTOL` (relative);
  * after `--warmup` untimed steps each, the implementations take turns step by step (the order
    rotates every round) so that machine noise hits all alike. A world barrier precedes every step;
    the step time is the slowest rank's, each phase is timed with `time.perf_counter` on every rank
    (CPU work is synchronous) and reported as the mean over ranks;
  * one more step per implementation runs under `torch.profiler` (profile_memory) to find the peak of
    the bytes allocated during a step above what was live before it (activations, gathered
    parameters, communication buffers), and to count FSDP2's collectives by wrapping
    `dist.all_gather_single` / `dist.reduce_scatter_single`. Bytes are per-rank ring volumes, as
    meshtron's `Comm` counts them; torch DDP's all-reduce volume is from theory (its reducer calls gloo
    from C++, where Python cannot see it);
  * state bytes = parameters + gradients + optimizer state held by one rank, counted once per tensor
    storage (DTensors by their local shard) right after the optimizer step, before zero_grad;
  * to explain the differences: minor page faults per step (`getrusage`: first touches of freshly
    allocated memory), and the bare gloo all-reduce / reduce-scatter / all-gather of one flat buffer
    the size of the whole gradient, the floor under every engine's synchronisation. The results
    section ends with what limits each meshtron engine, from these numbers and the phase split.

Run `python benchmarks/data_parallel.py` (writes its section of benchmarks/RESULTS.md), or e.g.
`python benchmarks/data_parallel.py --steps 10 --warmup 2 --out - --profile`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    ModelShape,
    allocation_peak,
    cpu_model,
    median_ci,
    mib,
    ms,
    quantile,
    timed_run_parser,
    write_results,
)
from torch import nn

from meshtron.comm import Comm
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import Transformer, build_model
from meshtron.parallel.ddp import DistributedDataParallel
from meshtron.parallel.engine import DataParallelEngine
from meshtron.parallel.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.parallel.zero import ZeroShardedOptimizer
from meshtron.testing.workers import WorkerPool
from meshtron.train.metrics import model_state_bytes, storage_bytes
from meshtron.train.optim import build_optimizer, clip_grad_norm_

SECTION_TITLE = "## Data parallel: meshtron vs PyTorch DDP and FSDP2 (4 gloo ranks, CPU)"
WORLD = 4
LOSS_RTOL = 1e-5
MAX_NORM = 1.0
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
PHASES = ("forward", "backward", "sync", "clip", "optimizer", "after_step", "zero_grad")

# name -> the torch implementation it is compared with (None: it is a torch implementation).
IMPLEMENTATIONS: dict[str, str | None] = {
    "meshtron DDP": "torch DDP",
    "torch DDP": None,
    "meshtron ZeRO-3": "torch FSDP2",
    "torch FSDP2": None,
    "meshtron ZeRO-1": "torch DDP",
    "meshtron ZeRO-2": "torch DDP",
}


@dataclass(frozen=True)
class Shape(ModelShape):
    batch_per_rank: int = 2

    def text(self) -> str:
        return (
            f"{self.model_text()}, {self.batch_per_rank} sequences per rank "
            f"({WORLD * self.batch_per_rank} global)"
        )


# -- what runs on every rank --


class Runner:
    """One data-parallel implementation on this rank: its model, optimizer and per-phase calls."""

    def __init__(
        self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, loss_scale: float = 1.0
    ):
        self.name, self.model, self.optimizer, self.loss_scale = name, model, optimizer, loss_scale

    def prepare(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def clip(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM, foreach=True)

    def after_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        states = [
            t
            for state in self.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.numel() > 1  # not Adam's scalar step counter, as ours
        ]
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": storage_bytes(states),
        }

    def reset_comm_count(self) -> None:
        pass

    def comm_bytes(self) -> float | None:
        """Per-rank bytes of this step's collectives, where they are counted (None: not counted)."""
        return None


class OursRunner(Runner):
    def __init__(self, name: str, engine: DataParallelEngine, comm: Comm):
        optimizer = build_optimizer(engine.optimizer_params(), LR, BETAS, EPS, WEIGHT_DECAY)
        super().__init__(name, engine.model, optimizer)
        self.engine, self.comm = engine, comm

    def prepare(self) -> None:
        self.engine.prepare_micro_batch(is_last=True)

    def sync(self) -> None:
        self.engine.finish_gradients()

    def clip(self) -> torch.Tensor:
        return clip_grad_norm_(self.engine, MAX_NORM, self.comm)

    def after_step(self) -> None:
        self.engine.after_step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.engine, self.optimizer)

    def reset_comm_count(self) -> None:
        self.comm.stats.reset()

    def comm_bytes(self) -> float | None:
        return self.comm.stats.total_bytes()


class TorchDDPRunner(Runner):
    def __init__(self, model: Transformer, group: Any, bucket_mb: float):
        # gradient_as_bucket_view: .grad is a view of the bucket, as in ours (no copy in, no copy out,
        # no second gradient-sized buffer); zero_grad then keeps the views instead of freeing them.
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True
        )
        optimizer = build_optimizer(list(model.parameters()), LR, BETAS, EPS, WEIGHT_DECAY)
        # DDP averages over its ranks; ours sum. Scaling the loss by the world size makes them equal.
        super().__init__("torch DDP", ddp, optimizer, loss_scale=float(dist.get_world_size(group)))
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.world = dist.get_world_size(group)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def comm_bytes(self) -> float | None:
        # One ring all-reduce of every gradient (bucketed); the clip norm is local (replicated grads).
        return 2 * self.grad_bytes * (self.world - 1) / self.world


class TorchFSDPRunner(Runner):
    """FSDP2's collectives are counted only in the profiled step (see `count_fsdp2_collectives`)."""

    def __init__(self, engine: TorchFSDP):
        optimizer = build_optimizer(engine.optimizer_params(), LR, BETAS, EPS, WEIGHT_DECAY)
        super().__init__("torch FSDP2", engine.model, optimizer)


@contextlib.contextmanager
def count_fsdp2_collectives() -> Iterator[list[float]]:
    """Yields [bytes]: the ring volume of FSDP2's all-gathers and reduce-scatters, counted the way
    meshtron's Comm counts its own. FSDP2 calls them as `dist.all_gather_single` /
    `dist.reduce_scatter_single`, looked up at call time, so wrapping those two sees every one."""
    originals = dist.all_gather_single, dist.reduce_scatter_single
    total = [0.0]

    def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, **kw: Any) -> Any:
        n = dist.get_world_size(group)
        total[0] += output.numel() * output.element_size() * (n - 1) / n
        return originals[0](output, input, group=group, **kw)

    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kw: Any) -> Any:
        n = dist.get_world_size(kw.get("group"))
        total[0] += input.numel() * input.element_size() * (n - 1) / n
        return originals[1](output, input, *args, **kw)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        yield total
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals


def build_runners(shape: Shape, seed: int, bucket_mb: float, names: Sequence[str]) -> list[Runner]:
    mesh = ParallelMesh(ParallelDims(dp_shard=dist.get_world_size()), "cpu")
    dp, shard, replicate = mesh.group("dp"), mesh.group("dp_shard"), mesh.group("dp_replicate")
    cfg = shape.model_config()
    bucket_bytes = int(bucket_mb * 2**20)
    runners: list[Runner] = []
    for name in names:
        model = build_model(cfg, seed=seed)
        blocks = list(model.layers.values())
        comm = Comm()
        if name == "meshtron DDP":
            runners.append(OursRunner(name, DistributedDataParallel(model, comm, dp, bucket_bytes), comm))
        elif name == "torch DDP":
            runners.append(TorchDDPRunner(model, dp.process_group, bucket_mb))
        elif name == "meshtron ZeRO-3":
            engine = FullyShardedDataParallel(
                model,
                blocks,
                comm,
                shard,
                replicate,
                torch.float32,
                torch.float32,
                True,
                mesh.mesh("dp_shard"),
            )
            runners.append(OursRunner(name, engine, comm))
        elif name == "torch FSDP2":
            engine = TorchFSDP(
                model, blocks, mesh.mesh("dp_shard"), shard, torch.float32, torch.float32, True
            )
            runners.append(TorchFSDPRunner(engine))
        elif name in ("meshtron ZeRO-1", "meshtron ZeRO-2"):
            stage = int(name[-1])
            engine = ZeroShardedOptimizer(
                model, comm, shard, replicate, stage, bucket_bytes, None, mesh.mesh("dp_shard")
            )
            runners.append(OursRunner(name, engine, comm))
        else:
            raise ValueError(f"unknown implementation {name!r}")
    return runners


def batch(shape: Shape, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of `step` (inputs, next-token targets)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, shape.vocab, (WORLD * shape.batch_per_rank, shape.seq + 1), generator=generator)
    rows = tokens[dist.get_rank() * shape.batch_per_rank : (dist.get_rank() + 1) * shape.batch_per_rank]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@dataclass
class StepRecord:
    phases: dict[str, float]
    loss: float  # global mean cross-entropy
    comm_bytes: float | None
    minor_faults: int  # page faults during the step: first touches of freshly mapped memory
    state: dict[str, int] | None = None
    alloc_peak: int | None = None


def train_step(
    runner: Runner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    global_tokens: int,
    measure_state: bool = False,
) -> StepRecord:
    """One step, driven exactly as meshtron's Trainer drives an engine; seconds per phase."""
    dist.barrier()  # every rank starts together, so the step time is not another rank's leftover
    runner.reset_comm_count()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase], clock = now - clock, now

    runner.prepare()
    logits = runner.model(inputs)
    ce_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss = ce_sum * (runner.loss_scale / global_tokens)
    lap("forward")
    loss.backward()
    lap("backward")
    runner.sync()
    lap("sync")
    runner.clip()
    lap("clip")
    runner.optimizer.step()
    lap("optimizer")
    runner.after_step()
    lap("after_step")
    # Before zero_grad, which may free gradients; the count itself is not part of the step.
    state = runner.state_bytes() if measure_state else None
    clock = time.perf_counter()
    runner.zero_grad()
    lap("zero_grad")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    comm_bytes = runner.comm_bytes()
    # Outside the timed region: the metric, not part of training.
    mean_ce = (ce_sum.detach() / global_tokens).reshape(1)
    dist.all_reduce(mean_ce)
    return StepRecord(seconds, float(mean_ce), comm_bytes, faults, state)


def profiled_step(
    runner: Runner, inputs: torch.Tensor, targets: torch.Tensor, global_tokens: int, op_table: bool
) -> tuple[StepRecord, str]:
    """An untimed step under the profiler: allocation peak, state bytes, FSDP2's bytes, op table."""
    from torch.profiler import ProfilerActivity, profile

    fsdp2 = isinstance(runner, TorchFSDPRunner)
    counting = count_fsdp2_collectives() if fsdp2 else contextlib.nullcontext([0.0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, counting as counted:
        record = train_step(runner, inputs, targets, global_tokens, measure_state=True)
    if fsdp2:
        record.comm_bytes = counted[0]
    record.alloc_peak = allocation_peak(prof)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) if op_table else ""
    return record, table


def collective_floor(numel: int, reps: int) -> dict[str, list[float]]:
    """Seconds of bare gloo collectives on one flat fp32 buffer the size of the whole gradient: the floor
    under every engine's synchronisation, with no engine code around it. The ops take turns, as the
    engines do, so that noise hits them alike."""
    n = dist.get_world_size()
    numel += -numel % n
    full, shard = torch.randn(numel), torch.empty(numel // n)
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather": lambda: dist.all_gather_single(full, shard),
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
    shape: Shape, names: Sequence[str], seed: int, warmup: int, steps: int, bucket_mb: float, op_table: bool
) -> dict[str, Any]:
    """Runs on every rank: warmup, interleaved timed steps, one profiled step per implementation."""
    torch.set_num_threads(1)
    runners = build_runners(shape, seed, bucket_mb, names)
    global_tokens = WORLD * shape.batch_per_rank * shape.seq
    records: dict[str, list[StepRecord]] = {r.name: [] for r in runners}
    for step in range(warmup + steps):
        inputs, targets = batch(shape, seed, step)
        shift = step % len(runners)  # rotate who goes first, so no one always follows the same neighbour
        for runner in runners[shift:] + runners[:shift]:
            records[runner.name].append(train_step(runner, inputs, targets, global_tokens))
    inputs, targets = batch(shape, seed, warmup + steps)
    profiled, tables = {}, {}
    for runner in runners:
        profiled[runner.name], tables[runner.name] = profiled_step(
            runner, inputs, targets, global_tokens, op_table and dist.get_rank() == 0
        )
    n_params = sum(p.numel() for p in build_model(shape.model_config(), seed).parameters())
    floor = collective_floor(n_params, reps=max(5, steps // 2))
    # Plain dicts: this module is __mp_main__ in the workers, a name the parent cannot unpickle.
    return {
        "warmup": {name: [asdict(r) for r in recs[:warmup]] for name, recs in records.items()},
        "timed": {name: [asdict(r) for r in recs[warmup:]] for name, recs in records.items()},
        "profiled": {name: asdict(r) for name, r in profiled.items()},
        "tables": tables,
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "n_params": n_params,
        "floor": floor,
    }


# -- what the parent does with the ranks' results --


@dataclass
class Summary:
    name: str
    step_s: list[float]  # per timed step: the slowest rank's step time
    phase_s: dict[str, list[float]]  # per timed step: the mean over ranks
    faults: list[float]  # per timed step: the mean over ranks
    losses: list[float]  # every step, warmup and profiled included
    state: dict[str, int]  # the largest rank's
    alloc_peak: int
    comm_bytes: float | None
    reference: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_faults(self) -> float:
        return statistics.median(self.faults)

    def phase_median(self, phase: str) -> float:
        return statistics.median(self.phase_s[phase])


def summarise(results: list[dict[str, Any]]) -> dict[str, Summary]:
    out = {}
    for name in results[0]["timed"]:
        per_rank = [r["timed"][name] for r in results]
        n = len(per_rank[0])
        step_s = [max(sum(ranks[i]["phases"].values()) for ranks in per_rank) for i in range(n)]
        phase_s = {
            p: [statistics.fmean(ranks[i]["phases"][p] for ranks in per_rank) for i in range(n)]
            for p in PHASES
        }
        faults = [statistics.fmean(ranks[i]["minor_faults"] for ranks in per_rank) for i in range(n)]
        rank0 = results[0]
        losses = [
            rec["loss"] for rec in (*rank0["warmup"][name], *rank0["timed"][name], rank0["profiled"][name])
        ]
        profiled = [r["profiled"][name] for r in results]
        state = max((rec["state"] for rec in profiled), key=lambda s: sum(s.values()))
        out[name] = Summary(
            name=name,
            step_s=step_s,
            phase_s=phase_s,
            faults=faults,
            losses=losses,
            state=state,
            alloc_peak=max(rec["alloc_peak"] for rec in profiled),
            comm_bytes=profiled[0]["comm_bytes"],
            reference=IMPLEMENTATIONS.get(name),
        )
    return out


def loss_check(s: Summary, ref: Summary) -> tuple[float, bool]:
    worst = max(abs(a - b) / abs(b) for a, b in zip(s.losses, ref.losses, strict=True))
    return worst, worst <= LOSS_RTOL


def paired_verdict(s: Summary, ref: Summary) -> tuple[float, float, float, str]:
    """Median and 95% CI of the per-round ratios, and what they say."""
    ratios = sorted(a / b for a, b in zip(s.step_s, ref.step_s, strict=True))
    lo, hi = median_ci(ratios)
    verdict = "no significant difference" if lo <= 1.0 <= hi else ("faster" if hi < 1.0 else "slower")
    return statistics.median(ratios), lo, hi, verdict


def paired_text(s: Summary, ref: Summary) -> str:
    median, lo, hi, verdict = paired_verdict(s, ref)
    return f"per-round ratio median {median:.3f} (95% CI {lo:.3f}-{hi:.3f}): {verdict}"


TABLE_HEADER = (
    "| implementation | median step ms | p10 ms | p90 ms | ratio vs torch | state MiB per rank "
    "(params / grads / optim) | peak step allocations MiB | comm MiB per step per rank |"
)
TABLE_RULE = "|---|---:|---:|---:|---:|---|---:|---:|"
PHASE_HEADER = (
    "| implementation | forward | backward | sync | clip | optimizer | after_step | zero_grad "
    "| minor page faults per step |"
)
PHASE_RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"


def table_rows(summaries: dict[str, Summary]) -> list[str]:
    rows = []
    for s in summaries.values():
        ref = summaries.get(s.reference) if s.reference else None
        ratio = f"**{s.median / ref.median:.3f}** (vs {ref.name})" if ref else ""
        state = s.state
        comm = "not counted" if s.comm_bytes is None else mib(s.comm_bytes)
        if s.name == "torch DDP":
            comm += " (theory)"
        rows.append(
            f"| {s.name} | {ms(s.median)} | {ms(quantile(s.step_s, 0.1))} | {ms(quantile(s.step_s, 0.9))} | "
            f"{ratio} | {mib(sum(state.values()))} ({mib(state['params'])} / {mib(state['grads'])} / "
            f"{mib(state['optimizer'])}) | {mib(s.alloc_peak)} | {comm} |"
        )
    return rows


def phase_rows(summaries: dict[str, Summary]) -> list[str]:
    return [
        f"| {s.name} | " + " | ".join(ms(s.phase_median(p)) for p in PHASES) + f" | {s.median_faults:,.0f} |"
        for s in summaries.values()
    ]


def check_lines(summaries: dict[str, Summary]) -> list[str]:
    lines = []
    for s in summaries.values():
        ref = summaries.get(s.reference) if s.reference else None
        if ref is None:
            continue
        worst, ok = loss_check(s, ref)
        lines.append(
            f"- {s.name} vs {ref.name}: losses over {len(s.losses)} steps, first {s.losses[0]:.6f} vs "
            f"{ref.losses[0]:.6f}, last {s.losses[-1]:.6f} vs {ref.losses[-1]:.6f}, max relative difference "
            f"{worst:.1e} ({'ok' if ok else 'FAILED'}, tolerance {LOSS_RTOL:.0e}); {paired_text(s, ref)}"
        )
    return lines


def command_text(argv: Sequence[str]) -> str:
    return " ".join(["python", "benchmarks/data_parallel.py", *argv])


def section_text(
    summaries: dict[str, Summary],
    results: list[dict[str, Any]],
    shape: Shape,
    args: argparse.Namespace,
    argv: Sequence[str],
    wall_s: float,
    findings: str,
) -> str:
    n_params = results[0]["n_params"]
    rss = max(r["max_rss"] for r in results)
    lines = [
        SECTION_TITLE,
        "",
        "One training step (forward + cross-entropy loss + backward + gradient sync + global-norm clipping "
        f"to {MAX_NORM} + `AdamW(lr={LR}, foreach=True)` step + post-step work + zero_grad) of the same "
        "meshtron Llama model on the same random token batches, every implementation in the same 4-rank gloo "
        "world, each with its own copy of the model and optimizer. Every meshtron engine is driven as the "
        "Trainer drives it (`prepare_micro_batch(is_last=True)`, forward, backward, `finish_gradients()`, "
        "`clip_grad_norm_`, `optimizer.step()`, `after_step()`, `zero_grad()`); torch DDP "
        "(`gradient_as_bucket_view=True`, `zero_grad(set_to_none=False)`, same bucket size) and FSDP2 "
        "(`fully_shard` on every block and the root, `reshard_after_forward=True`, through `TorchFSDP`) clip "
        "with `torch.nn.utils.clip_grad_norm_`. The gradient math is identical: meshtron sums gradients and "
        "divides the loss by the global token count; torch DDP averages, so its loss is multiplied by the "
        "world size (exact: powers of two); FSDP2 is set to sum. The implementations take turns step by step "
        "after warmup, the order rotating every round; a barrier precedes every step. **step** = the slowest "
        "rank's time; the phase table is the median over steps of the mean over ranks. **ratio** = median "
        "meshtron step / median torch step (< 1: meshtron faster); ZeRO-1/2 are compared with torch DDP for "
        "context. **state** = params + grads + optimizer state of the largest rank, counted once per tensor "
        "storage after the optimizer step (before zero_grad). **peak step allocations** = peak of bytes "
        "allocated minus freed during one step, from `torch.profiler(profile_memory=True)` (activations, "
        "gathered parameters, communication buffers including gloo's own, new gradients); for the engines "
        "with asynchronous collectives it moves between runs by up to about 10 MiB, with when the "
        "collectives release their buffers. **comm** = per-rank ring volume: "
        "meshtron's `comm.stats.total_bytes()`; FSDP2's all-gathers and reduce-scatters counted by wrapping "
        "`dist.all_gather_single` / `dist.reduce_scatter_single` (its grad-norm scalar not counted); torch "
        "DDP's from theory, 2 x 4 bytes x params x (n-1)/n. These are the volumes of ring algorithms; gloo "
        "runs every reduce-scatter as a full all-reduce (see below), so on this backend the sharded engines, "
        "meshtron's and FSDP2's alike, really move an all-reduce's volume where a reduce-scatter is counted.",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other jobs); {WORLD} ranks x "
        "`torch.set_num_threads(1)`: 4 single-threaded ranks on "
        f"{os.cpu_count()} cores is oversubscribed, so every collective also waits for the OS to schedule "
        "its peers, and absolute times are noisy",
        f"- model: {shape.text()}; {n_params / 1e6:.2f}M parameters, fp32; bucket {args.bucket_mb:g} MiB "
        "(DDP and ZeRO-1/2, both sides)",
        f"- {args.steps} timed steps per implementation after {args.warmup} warmup, plus one profiled step; "
        f"run took {wall_s:.0f} s; peak RSS per rank (all six implementations live in each rank): "
        f"{rss / 2**20:.0f} MiB",
        f"- reproduce: `{command_text(argv)}`",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *table_rows(summaries),
        "",
        "Median ms per phase (torch DDP and FSDP2 wait for their reductions inside `backward`, ours in `sync`; "
        "ZeRO-1/2 all-gather the updated parameters in `after_step`):",
        "",
        PHASE_HEADER,
        PHASE_RULE,
        *phase_rows(summaries),
        "",
        "Checks (global mean loss of every step, warmup and profiled step included) and noise (per-round "
        "ratio: each timed step against the torch step of the same round):",
        "",
        *check_lines(summaries),
    ]
    lines += ["", findings]
    return "\n".join(lines) + "\n"


def print_summary(summaries: dict[str, Summary], findings: str) -> None:
    """The same tables and text as the results section, for a run with `--out -`."""
    print("\n".join(["", TABLE_HEADER, TABLE_RULE, *table_rows(summaries), ""]))
    print("\n".join([PHASE_HEADER, PHASE_RULE, *phase_rows(summaries), ""]))
    print("\n".join([*check_lines(summaries), "", findings]))


def floor_ms(results: list[dict[str, Any]]) -> dict[str, float]:
    """Median over repetitions of the slowest rank's time of each bare collective, in ms."""
    out = {}
    for op in results[0]["floor"]:
        reps = len(results[0]["floor"][op])
        out[op] = 1e3 * statistics.median(max(r["floor"][op][i] for r in results) for i in range(reps))
    return out


# Phases compared between an engine and its torch counterpart; torch waits for its reductions inside
# backward, so backward and sync only compare as a sum.
PHASE_GROUPS: dict[str, tuple[str, ...]] = {
    "forward": ("forward",),
    "backward + sync": ("backward", "sync"),
    "clip": ("clip",),
    "optimizer": ("optimizer",),
    "after_step": ("after_step",),
    "zero_grad": ("zero_grad",),
}


def phase_deltas(s: Summary, ref: Summary) -> dict[str, float]:
    """ms by which `s` is slower than `ref` per phase group (negative: faster)."""
    return {
        group: 1e3 * sum(s.phase_median(p) - ref.phase_median(p) for p in phases)
        for group, phases in PHASE_GROUPS.items()
    }


def delta_text(s: Summary, ref: Summary) -> str:
    deltas = sorted(phase_deltas(s, ref).items(), key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{group} {d:+.1f} ms" for group, d in deltas if abs(d) >= 0.5)


def findings_text(summaries: dict[str, Summary], floor: dict[str, float], bucket_mb: float) -> str:
    """What limits each meshtron engine against its torch counterpart, from this run's phase medians, page
    faults and the bare-collective floor. The mechanisms named were found by profiling these engines
    (`--profile`, and timing their FlatLayout copies and waits) and reading their code."""
    ar, rs, ag = floor["all_reduce"], floor["reduce_scatter"], floor["all_gather"]
    lines = [
        "### What limits the numbers",
        "",
        f"Bare gloo collectives on one flat fp32 buffer the size of the whole gradient (slowest rank, median): "
        f"all-reduce {ar:.1f} ms, reduce-scatter {rs:.1f} ms, all-gather {ag:.1f} ms. The reduce-scatter "
        "costs more than the all-reduce because gloo has none of its own: "
        "`ProcessGroupGloo::reduce_scatter_tensor_coalesced` clones the whole input, all-reduces the clone "
        "and copies this rank's chunk out, so its time also depends on how fast the clone's fresh pages are "
        "faulted in (it varies from run to run with the state of the heap). Phase differences are meshtron "
        "minus torch (median ms; + means meshtron spends longer); `sync` also holds the wait for the slowest "
        "rank to finish backward.",
        "",
    ]
    get = summaries.get
    ddp, tddp = get("meshtron DDP"), get("torch DDP")
    if ddp and tddp:
        d = phase_deltas(ddp, tddp)
        sync_ms = ddp.phase_median("sync") * 1e3
        if bucket_mb * 2**20 >= ddp.state["grads"]:
            bucket_text = (
                f"With `bucket_mb={bucket_mb:g}` the whole gradient is one bucket, so its all-reduce starts "
                f"only when backward ends and all of it shows in `sync` ({sync_ms:.1f} ms); torch DDP's first "
                "bucket is 1 MiB and the rest also waits for the end of backward, so neither overlaps much "
                "at this size (`--bucket-mb 4` overlaps more on both sides)."
            )
        else:
            bucket_text = (
                f"The last bucket's all-reduce (the embedding's, last in backward) is exposed in `sync` "
                f"({sync_ms:.1f} ms); the earlier ones overlap backward, as torch DDP's do."
            )
        lines.append(
            f"- **DDP** (ratio {ddp.median / tddp.median:.3f}, {paired_verdict(ddp, tddp)[3]}): "
            f"{delta_text(ddp, tddp)}. The same all-reduce volume from persistent buckets on both sides. "
            f"Clipping ({d['clip']:+.1f} ms): both sides run the same kernels (`torch._foreach_norm`, "
            "`torch._foreach_mul_`), which take the same time single-threaded in one process for this model "
            "(about 0.85 ms each, measured separately); the gap under four oversubscribed ranks is not "
            f"explained. {bucket_text}"
        )
    zeros = [z for z in (get("meshtron ZeRO-1"), get("meshtron ZeRO-2")) if z]
    if zeros and tddp:
        ratios = ", ".join(f"{z.name.split()[-1]} {z.median / tddp.median:.3f}" for z in zeros)
        deltas = "; ".join(f"{z.name.split()[-1]}: {delta_text(z, tddp)}" for z in zeros)
        faults = ", ".join(f"{z.name.split()[-1]} {z.median_faults:,.0f}" for z in zeros)
        lines.append(
            f"- **ZeRO-1/2 vs torch DDP** (ratios {ratios}; context, not a like-for-like pair): {deltas}. "
            "Mostly the algorithm on this backend: in theory a reduce-scatter plus an all-gather moves the "
            "same bytes as one all-reduce, but gloo has no reduce-scatter of its own (its "
            f"`reduce_scatter_tensor` is an all-reduce of a clone, {rs:.1f} ms bare). meshtron's "
            "`Comm.reduce_scatter_async` therefore all-reduces its private packed send buffer in place and "
            f"keeps its own chunk, so the ZeRO pair costs about an all-reduce plus an all-gather "
            f"({ar + ag:.1f} ms bare) where DDP pays one all-reduce ({ar:.1f} ms); the sharded AdamW step "
            "pays part of it back. Then the engine: `after_step` all-gathers the updated "
            "rows and waits for them before the step ends (nothing overlaps it; waiting per bucket in a "
            "forward pre-hook of the next step would hide it behind forward), and every step allocates "
            "its full-size communication buffers afresh (`send` in `_launch`, `segment` and `gathered` in "
            "`after_step`) and copies through them (`FlatLayout.pack` / `pack_local` / `unpack`). Fresh "
            f"buffers are first touched page by page: minor page faults per step {faults} against torch "
            f"DDP's {tddp.median_faults:,.0f}. Single-threaded, packing the whole gradient takes about 2 ms "
            "into a reused buffer and about 8 ms into a fresh one while other large buffers are alive; "
            "persistent send / gather buffers would remove that part."
        )
    z2 = get("meshtron ZeRO-2")
    if z2 and ddp and z2.alloc_peak > ddp.alloc_peak:
        lines.append(
            f"- **ZeRO-2 memory**: its peak step allocations ({mib(z2.alloc_peak)} MiB) exceed DDP's "
            f"({mib(ddp.alloc_peak)} MiB) although its steady state is smaller: with one {bucket_mb:g} MiB "
            "bucket the full gradients all live until the bucket launches, and `_launch` then packs them "
            "into a new full-size send buffer (all-reduced in place) before freeing them. Smaller buckets "
            "bound this transient to a few buckets."
        )
    z3, fsdp2 = get("meshtron ZeRO-3"), get("torch FSDP2")
    if z3 and fsdp2:
        lines.append(
            f"- **ZeRO-3 vs FSDP2** (ratio {z3.median / fsdp2.median:.3f}, {paired_verdict(z3, fsdp2)[3]}): "
            f"{delta_text(z3, fsdp2)}. Both move the same bytes (two all-gathers and one reduce-scatter "
            "of every parameter) over the same units, and both allocate gathered parameters and reduce "
            f"buffers per use (page faults per step {z3.median_faults:,.0f} vs {fsdp2.median_faults:,.0f}; "
            f"peak step allocations {mib(z3.alloc_peak)} vs {mib(fsdp2.alloc_peak)} MiB, see the caveat "
            "above). "
            "FSDP2's parameters and gradients are DTensors, so its `clip_grad_norm_` and foreach AdamW step "
            "go through DTensor dispatch, and its per-unit hooks do more Python work around the same gloo "
            "calls (`FSDP::all_gather` / `FSDP::post_backward_reduce` copy-in / copy-out in the profile); "
            "meshtron's units keep plain tensors and one flat buffer each."
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = timed_run_parser(__doc__, "data-parallel")
    parser.add_argument(
        "--bucket-mb", type=float, default=25.0, help="DDP / ZeRO-1/2 bucket size, both sides"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(IMPLEMENTATIONS),
        metavar="NAME",
        help=f"run a subset (quote names): {', '.join(IMPLEMENTATIONS)}",
    )
    parser.add_argument("--profile", action="store_true", help="print rank 0's op table of the profiled step")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shape = Shape()
    names = args.only or list(IMPLEMENTATIONS)
    print(
        f"{WORLD} gloo ranks, {shape.text()}; {args.warmup} warmup + {args.steps} timed steps each: {', '.join(names)}"
    )
    start = time.perf_counter()
    pool = WorkerPool(WORLD, timeout_s=1800)
    try:
        results = pool.run(
            bench_rank, shape, names, args.seed, args.warmup, args.steps, args.bucket_mb, args.profile
        )
    finally:
        pool.close()
    wall_s = time.perf_counter() - start
    if args.profile:
        for name, table in results[0]["tables"].items():
            print(f"\n== {name} (rank 0, profiled step) ==\n{table}")
    summaries = summarise(results)
    findings = findings_text(summaries, floor_ms(results), args.bucket_mb)
    print_summary(summaries, findings)
    failed = [
        s.name
        for s in summaries.values()
        if s.reference in summaries and not loss_check(s, summaries[s.reference])[1]
    ]
    if args.out != "-":
        write_results(
            Path(args.out),
            SECTION_TITLE,
            section_text(summaries, results, shape, args, argv, wall_s, findings),
        )
        print(f"\nwrote {args.out}")
    if failed:
        sys.exit(f"loss mismatch beyond {LOSS_RTOL:.0e}: {', '.join(failed)}")


if __name__ == "__main__":
    main()
