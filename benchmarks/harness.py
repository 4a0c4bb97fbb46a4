"""The harness every benchmark here runs on; a benchmark script defines only what it compares:

  * its implementations, as `Runner`s: a name and `step(batch, clock)`, which runs one step, closes each
    phase it reports with `clock.lap(phase)` and returns the step's global loss. Optional hooks count the
    step's collectives (`counting`), record state where the step calls `clock.snapshot(self)`
    (`snapshot`) and give gradients to the parity check (`grads`);
  * the `Pair`s (ours, peer) to compare, and its tables of the `Samples`.

`run_rounds` runs them alike, on every rank of a gloo world (`run_world`) or in one process:
  1. parity before timing: every runner takes the check step(s) on the same batch from the same weights;
     each pair's losses (and gradients, where `grads` gives them; and the single-device losses, where the
     script has them) must agree to `RTOL`, or nothing is timed and the run exits non-zero. The losses of
     all later steps must agree too;
  2. warm-up, then timed rounds: each runner takes one step per round on the round's batch, the order
     rotating by one every round so that machine noise hits all alike; a barrier precedes every step.
     A step's time is the sum of its laps on the slowest rank, a phase's the mean over ranks;
  3. optionally one measured step per runner: peak allocations (`torch.profiler(profile_memory=True)`),
     collectives per phase (calls, per-rank ring bytes) and the snapshot.
What the parent makes of the ranks' results (statistics, tables, the results file) is `reporting.py`.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm.collectives import Comm
from meshtron.comm.workers import WorkerPool
from meshtron.utils.resident import resident_peak_bytes

RTOL = 1e-5  # relative tolerance of every parity check


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# The MoE model of the expert-parallel benchmarks: every layer MoE, 8 experts, top-2, byte tokens.
MOE_MODEL = (
    "--model.dim=256",
    "--model.n_layers=4",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.ffn_dim=688",
    "--model.n_experts=8",
    "--model.top_k=2",
    "--model.moe_ffn_dim=512",
    "--model.vocab_size=260",
    "--data.tokenizer=byte",
    "--training.seq_len=256",
)


def freeze_at_zero_lr(optimizer: torch.optim.Optimizer) -> None:
    """Every later `optimizer.step` runs in full (AdamW's state moves) at learning rate 0, so the weights
    stay as they are: training on, two layouts that sum gradients in different orders would flip a
    near-tied top-k assignment within a dozen steps and part at the 1e-3 level."""
    update = optimizer.step

    def step_at_zero_lr(*args: Any, **kwargs: Any) -> Any:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        return update(*args, **kwargs)

    optimizer.step = step_at_zero_lr


# -- what runs on every rank --


class Counter:
    """Collectives an implementation ran, cumulative: calls and per-rank ring bytes, counted as meshtron's
    `Comm` counts them (an all-reduce moves 2 (n-1)/n of the tensor, an all-gather or reduce-scatter
    (n-1)/n of the full tensor)."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0.0

    def add(self, op: str, full_bytes: float, world: int) -> None:
        self.calls += 1
        self.bytes += full_bytes * (world - 1) / world * (2 if op == "all_reduce" else 1)

    def totals(self) -> tuple[int, float]:
        return self.calls, self.bytes


class CommCounter(Counter):
    """meshtron's own accounting (`Comm.stats`)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def totals(self) -> tuple[int, float]:
        return self.comm.stats.total_calls(), self.comm.stats.total_bytes()


class Clock:
    """The stopwatch of one step, handed to `Runner.step`: `lap(phase)` closes a phase (one lapped twice
    adds up); time after the last lap, or before `skip()`, is not timed. In the measured step it also
    splits the counted collectives by phase and records the runner's snapshot."""

    def __init__(self, counter: Counter | None = None, measure: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.comm: dict[str, tuple[int, float]] = {}  # phase -> (calls, bytes), in the measured step
        self.notes: dict[str, Any] = {}  # anything a runner records about its step
        self.counter, self.measure = counter, measure
        self._counted = counter.totals() if counter else (0, 0.0)
        self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self._start
        if self.counter is not None:
            (calls, nbytes), (c, b) = self.counter.totals(), self.comm.get(phase, (0, 0.0))
            self.comm[phase] = (c + calls - self._counted[0], b + nbytes - self._counted[1])
            self._counted = (calls, nbytes)
        self.skip()

    def skip(self) -> None:
        self._start = time.perf_counter()

    def snapshot(self, runner: Runner) -> None:
        """In the measured step, record `runner.snapshot()` here (untimed)."""
        if self.measure:
            self.notes.update(runner.snapshot())
        self.skip()


class Runner:
    """An implementation under test, on this rank."""

    name: str

    def step(self, batch: Any, clock: Clock) -> float:
        """One step on `batch`, phases closed by `clock.lap`; returns the global loss."""
        raise NotImplementedError

    def counting(self) -> contextlib.AbstractContextManager[Counter | None]:
        """Counts this implementation's collectives in the measured step (None: not counted)."""
        return contextlib.nullcontext(None)

    def snapshot(self) -> dict[str, Any]:
        """What the measured step records at `clock.snapshot(self)`, e.g. {"state": state_bytes(...)}."""
        return {}

    def grads(self) -> dict[str, torch.Tensor] | None:
        """Gradients by parameter name after a step, for the parity check (None: not compared)."""
        return None


@dataclass(frozen=True)
class Pair:
    """`ours` against `peer`: a timing ratio, and a parity check unless `check` is False."""

    ours: str
    peer: str
    check: bool = True

    @property
    def label(self) -> str:
        return f"{self.ours} vs {self.peer}"


@dataclass
class Check:
    """A pair's losses (the first `checked` steps before any timing; the parent adds the later ones),
    the single-device losses of the first steps, if any, and the worst relative gradient difference after
    the check steps: (difference, tensor, tensors compared over all ranks)."""

    pair: Pair
    ours: list[float]
    peer: list[float]
    checked: int
    reference: list[float] | None = None
    grad: tuple[float, str, int] | None = None

    @property
    def worst_checked(self) -> float:
        return max(rel(a, b) for a, b in zip(self.ours[: self.checked], self.peer, strict=False))

    @property
    def worst_reference(self) -> float:
        pairs = [(x[i], r) for x in (self.ours, self.peer) for i, r in enumerate(self.reference or [])]
        return max((rel(a, r) for a, r in pairs), default=0.0)

    @property
    def worst(self) -> float:
        return max(rel(a, b) for a, b in zip(self.ours, self.peer, strict=True))

    @property
    def passed_before_timing(self) -> bool:
        return max(self.worst_checked, self.worst_reference, self.grad[0] if self.grad else 0.0) <= RTOL

    @property
    def ok(self) -> bool:
        return self.passed_before_timing and self.worst <= RTOL


@dataclass
class StepRecord:
    seconds: dict[str, float]
    loss: float
    faults: int  # minor page faults: first touches of freshly allocated memory
    notes: dict[str, Any]
    comm: dict[str, tuple[int, float]]
    alloc_peak: int = 0
    collectives: int = 0  # c10d dispatcher ops in the measured step: every backend call, traced or not
    op_table: str = ""


@dataclass
class RankResult:
    """What `run_rounds` returns from one rank; `extra` is the script's own."""

    records: dict[str, list[StepRecord]]  # per runner, every step in order: check, warm-up, timed
    first_timed: int
    pairs: list[Pair]
    checks: list[Check]
    measured: dict[str, StepRecord] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    max_rss: int = 0


def run_step(runner: Runner, batch: Any, counter: Counter | None = None, measure: bool = False) -> StepRecord:
    if dist.is_initialized():
        dist.barrier()  # every rank starts together, so a step's time is not another rank's leftover
    faults, clock = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, Clock(counter, measure)
    loss = runner.step(batch, clock)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return StepRecord(clock.seconds, loss, faults, clock.notes, clock.comm)


def allocation_peak(prof: torch.profiler.profile) -> int:
    """Peak of bytes allocated minus freed since the profiler started (from its allocation events)."""
    from torch._C._profiler import _EventType

    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            nodes.append(node)
    current = peak = 0
    for node in sorted(nodes, key=lambda n: n.start_time_ns):
        current += node.extra_fields.alloc_size
        peak = max(peak, current)
    return peak


def measured_step(runner: Runner, batch: Any, op_table: bool) -> StepRecord:
    """An untimed step under the profiler, counting collectives and taking the runner's snapshot."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, runner.counting() as c:
        record = run_step(runner, batch, c, measure=True)
    record.alloc_peak = allocation_peak(prof)
    # Every collective, issued from Python or from a compiled graph, is one `c10d::` operator call.
    record.collectives = sum(
        1 for e in prof.events() if e.name.startswith("c10d::") and "barrier" not in e.name
    )
    if op_table:
        record.op_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return record


def parity(pairs: Sequence[Pair], records: dict, grads: dict, reference: list[float] | None) -> list[Check]:
    """The checks after the check steps, the same on every rank (gradients compared on every rank)."""
    local = {}
    for p in pairs:
        ours, peer = grads[p.ours], grads[p.peer]
        if ours is not None and peer is not None:
            diffs = [
                (float((g - peer[n]).norm() / peer[n].norm().clamp_min(1e-30)), n) for n, g in ours.items()
            ]
            local[p.label] = (*max(diffs), len(diffs))
    ranks = [local]
    if dist.is_initialized():
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, local)
    checks = []
    for p in pairs:
        per_rank = [r[p.label] for r in ranks if p.label in r]
        grad = (*max(per_rank)[:2], sum(g[2] for g in per_rank)) if per_rank else None
        losses = [[r.loss for r in records[name]] for name in (p.ours, p.peer)]
        checks.append(Check(p, *losses, len(losses[0]), reference, grad))
    return checks


def run_rounds(
    runners: Sequence[Runner],
    batch_of: Callable[[int], Any],
    pairs: Sequence[Pair],
    warmup: int,
    steps: int,
    check_steps: int = 1,
    reference: list[float] | None = None,
    measure: bool = True,
    op_tables: bool = False,
) -> RankResult:
    """Check steps and parity, warm-up and timed rounds, then the measured step (with `measure`, or for
    rank 0's op tables); the same on every rank."""
    records: dict[str, list[StepRecord]] = {r.name: [] for r in runners}

    def rounds(first: int, last: int) -> None:
        for i in range(first, last):
            batch, shift = batch_of(i), i % len(runners)  # rotate who goes first
            for runner in [*runners[shift:], *runners[:shift]]:
                records[runner.name].append(run_step(runner, batch))

    rounds(0, check_steps)
    checks = parity([p for p in pairs if p.check], records, {r.name: r.grads() for r in runners}, reference)
    result = RankResult(records, check_steps + warmup, list(pairs), checks)
    if all(c.passed_before_timing for c in checks):
        rounds(check_steps, check_steps + warmup + steps)
        if measure or op_tables:
            batch = batch_of(check_steps + warmup + steps)
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            result.measured = {r.name: measured_step(r, batch, op_tables and rank0) for r in runners}
    result.max_rss = resident_peak_bytes()
    return result


def run_world(world: int, fn: Callable[..., RankResult], *args: Any) -> list[RankResult]:
    """`fn(*args)` on every rank of a fresh `world`-rank gloo world (fn must be importable)."""
    pool = WorkerPool(world, timeout_s=1800)
    try:
        return pool.run(fn, *args)
    finally:
        pool.close()


def token_batch(vocab: int, rows: int, seq: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens drawn from (seed, step): inputs and next-token targets [rows, seq]."""
    tokens = torch.randint(
        0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed * 1_000_003 + step)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
