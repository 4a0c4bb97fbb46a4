"""Benchmark: meshtron's tensor parallel vs PyTorch's DTensor tensor parallel, gloo ranks on CPU (fp32).

What is measured: the wall time of one training step -- forward, vocab-parallel cross-entropy loss,
backward, and an `AdamW(foreach=True)` step with zero_grad -- of the same dense Llama model on the same
token batches, tensor-parallel over the whole world, for tp=2 (a 2-rank world) and then tp=4 (a 4-rank
world), each with and without sequence parallel:

  * meshtron: `build_model(cfg, seed)`, then `apply_tensor_parallel(model, comm, tp, sp)` (Megatron-style
    column / row-parallel layers, vocab-parallel embedding and head), loss
    `vocab_parallel_cross_entropy(logits_local, targets, plan, comm).sum() / n_tokens`;
  * PyTorch: the same `Transformer` built with the same seed (same weights), parallelised with
    `parallelize_module` on a 1-D DeviceMesh over the same ranks, as torchtitan does: ColwiseParallel
    for wq / wk / wv / w1 / w3, RowwiseParallel for wo / w2, RowwiseParallel(input_layouts=Replicate())
    for the embedding, ColwiseParallel for the head with Shard(-1) logits and `loss_parallel()` around
    the cross-entropy (the logits are never gathered, as on meshtron's side); with sequence parallel
    also SequenceParallel on the norms, PrepareModuleInput(Shard(1) -> Replicate) on attention and the
    feed-forward, and Shard(1) outputs of wo / w2 / the embedding;
  * PyTorch `torch-shared`: the same plan, except that attention's and the feed-forward's input becomes
    one Replicate DTensor (PrepareModuleInput with use_local_output=False) shared by their
    column-parallel projections. torchtitan's plan hands each projection a plain tensor that it wraps
    on its own, so backward reduces each projection's input gradient separately: five activation-size
    reductions per layer, where Megatron (and meshtron) reduce the summed gradient once per attention /
    feed-forward block. This variant shows how much of the gap that plan choice is.

meshtron's `Transformer.forward` applies the head as `F.linear(h, self.output.weight)` instead of
calling `self.output`, so ColwiseParallel's module hooks on `output` never run: the style still shards
the weight (Shard(0)), and the input conversion ColwiseParallel would do (Replicate, or all-gather the
sequence under sp) is a PrepareModuleOutput on the final norm instead. Everything else is plain
`torch.distributed.tensor.parallel`. RoPE needs nothing special: cos / sin are computed from the
(replicated) token positions outside the layers, and attention always sees the whole sequence.

How:
  * one gloo world per tp degree (`meshtron.testing.workers.WorkerPool`), `torch.set_num_threads(1)` per rank;
    all six implementations (meshtron / torch / torch-shared x tp / tp+sp) live in every rank at once,
    each with its own model copy and its own `torch.optim.AdamW(foreach=True)` over all its parameters
    (the same hyper-parameters everywhere). No gradient clipping on either side;
  * the token batches are random, drawn from (seed, step), and replicated over tp;
  * correctness: before timing means anything, the loss of step 1 (initial weights) and of step 2 (after
    one AdamW step, so it also checks the gradients) of every implementation must match an unsharded
    single-device model run on every rank to `LOSS_RTOL` (relative), and every torch variant's losses
    must agree with meshtron's at every step;
  * after `--warmup` untimed steps each, the implementations take turns step by step (the order rotates
    every round) so that machine noise hits all alike. A world barrier precedes every step; the step
    time is the slowest rank's, each phase (forward + loss, backward, optimizer + zero_grad) is timed
    with `time.perf_counter` on every rank (CPU work is synchronous) and reported as the mean over ranks;
  * state bytes = parameters + gradients + optimizer state held by one rank, counted once per tensor
    storage (DTensors by their local tensor) right after the optimizer step, before zero_grad;
  * one more untimed step per implementation counts the collectives of each phase: meshtron's from
    `comm.stats` (reset every step), torch's with a dispatch mode that sees DTensor's functional
    collectives, both as per-rank ring volumes; it also notes where torch's embedding gradient lives;
  * a last step per implementation runs under `torch.profiler(profile_memory=True)` for the peak of the
    bytes allocated during a step above what was live before it (activations, logits, communication
    buffers, new gradients).

Run `python benchmarks/tensor_parallel.py` (writes its section of benchmarks/RESULTS.md), or e.g.
`python benchmarks/tensor_parallel.py --steps 10 --warmup 2 --tp 2 --torch torch --out - --profile`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    ModelShape,
    allocation_peak,
    cpu_model,
    mib,
    ms,
    quantile,
    timed_run_parser,
    write_results,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.comm import Comm
from meshtron.config import ModelConfig
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import Transformer, build_model
from meshtron.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from meshtron.testing.workers import WorkerPool
from meshtron.train.metrics import storage_bytes

SECTION_TITLE = "## Tensor parallel: meshtron vs PyTorch DTensor TP (gloo, CPU)"
LOSS_RTOL = 1e-5
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
PHASES = ("forward", "backward", "optimizer")
IMPLS = ("meshtron", "torch", "torch-shared")


@dataclass(frozen=True)
class Shape(ModelShape):
    seq: int = 256
    batch: int = 4  # kv_heads=4 is divisible by tp=4, so both sides split the key/value heads

    def text(self) -> str:
        return f"{self.model_text()}, untied head, batch {self.batch} (replicated over tp)"


def variant_name(impl: str, sp: bool) -> str:
    return f"{impl} {'tp+sp' if sp else 'tp'}"


# -- what runs on every rank --


def make_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The same AdamW on every side: its update is elementwise, so sharding cannot change the math.
    Without sp the torch model keeps its norms as plain tensors beside DTensors, and one foreach call
    cannot mix the two, so each kind gets its own parameter group (one foreach call each)."""
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (dtensors, plain) if g]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)


@dataclass
class Runner:
    name: str
    impl: str
    sp: bool
    model: Transformer
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits, targets -> mean loss
    context: Callable[[], Any] = contextlib.nullcontext  # wraps forward and backward
    comm: Comm | None = None

    def comm_bytes(self) -> float | None:
        return self.comm.stats.total_bytes() if self.comm is not None else None

    def reset_comm(self) -> None:
        if self.comm is not None:
            self.comm.stats.reset()


def meshtron_runner(cfg: ModelConfig, seed: int, mesh: ParallelMesh, sp: bool) -> Runner:
    model = build_model(cfg, seed=seed)
    comm = Comm()
    plan = apply_tensor_parallel(model, comm, mesh.group("tp"), sp)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, plan, comm).sum() / targets.numel()

    return Runner(
        variant_name("meshtron", sp),
        "meshtron",
        sp,
        model,
        make_optimizer(list(model.parameters())),
        loss_fn,
        comm=comm,
    )


def torch_runner(cfg: ModelConfig, seed: int, mesh: ParallelMesh, sp: bool, impl: str) -> Runner:
    """impl "torch": torchtitan's plan. "torch-shared": the same, except that attention's and the
    feed-forward's input becomes one Replicate DTensor that their column-parallel projections share, so
    autograd sums the projections' input gradients before a single reduction (as Megatron does), where
    torchtitan's plan hands each projection a plain tensor that it wraps, and reduces, on its own."""
    model = build_model(cfg, seed=seed)
    tp_mesh = mesh.mesh("tp")
    # With sp the residual stream between blocks is sharded on the sequence (dim 1), as in torchtitan.
    residual = Shard(1) if sp else Replicate()
    shared = impl == "torch-shared"
    block_plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sp:
        block_plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    if sp or shared:
        block_plan |= {
            "attention": PrepareModuleInput(
                input_layouts=(residual, None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=not shared,
            ),
            "feed_forward": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=not shared
            ),
        }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    top_plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Only shards the weight: Transformer.forward calls F.linear(h, output.weight), not output(h).
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top_plan)
    # What ColwiseParallel would do to the head's input, done on the norm's output instead: a Replicate
    # DTensor (all-gathered under sp), so F.linear with the Shard(0) weight gives Shard(-1) logits.
    parallelize_module(
        model.norm,
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=residual, desired_output_layouts=Replicate(), use_local_output=False
        ),
    )

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return ce_sum / targets.numel()

    return Runner(
        variant_name(impl, sp),
        impl,
        sp,
        model,
        make_optimizer(list(model.parameters())),
        loss_fn,
        context=loss_parallel,
    )


def batch(shape: Shape, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of `step`, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def scalar(loss: torch.Tensor) -> float:
    return float(loss.to_local() if isinstance(loss, DTensor) else loss)


def state_bytes(runner: Runner) -> dict[str, int]:
    params = list(runner.model.parameters())
    states = [
        t
        for state in runner.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1  # not AdamW's step counters
    ]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": storage_bytes(states),
    }


@dataclass
class StepRecord:
    phases: dict[str, float]
    loss: float
    comm_bytes: float | None
    state: dict[str, int] | None = None
    alloc_peak: int | None = None


def train_step(
    runner: Runner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    measure_state: bool = False,
    observer: PhaseCollectives | None = None,
    keep_grads: bool = False,
) -> StepRecord:
    dist.barrier()  # every rank starts together, so the step time is not another rank's leftover
    runner.reset_comm()
    seconds: dict[str, float] = {}
    if observer is not None:
        observer.start()
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase] = seconds.get(phase, 0.0) + now - clock
        clock = now
        if observer is not None:
            observer.mark(phase)

    with runner.context():  # loss_parallel must cover backward too
        loss = runner.loss_fn(runner.model(inputs), targets)
        lap("forward")
        loss.backward()
        lap("backward")
    runner.optimizer.step()
    lap("optimizer")
    # Before zero_grad, which frees the gradients; the count itself is not part of the step.
    state = state_bytes(runner) if measure_state else None
    clock = time.perf_counter()
    if not keep_grads:
        runner.optimizer.zero_grad()
    lap("optimizer")
    return StepRecord(seconds, scalar(loss.detach()), runner.comm_bytes(), state)


class PhaseCollectives:
    """Collective calls and per-rank ring bytes of one step, split by phase."""

    def __init__(self) -> None:
        self.by_phase: dict[str, list[float]] = {}  # phase -> [calls, bytes]
        self._last = (0, 0.0)

    def totals(self) -> tuple[int, float]:
        raise NotImplementedError

    def start(self) -> None:
        self._last = self.totals()

    def mark(self, phase: str) -> None:
        calls, nbytes = self.totals()
        entry = self.by_phase.setdefault(phase, [0, 0.0])
        entry[0] += calls - self._last[0]
        entry[1] += nbytes - self._last[1]
        self._last = (calls, nbytes)


class CommCollectives(PhaseCollectives):
    """meshtron's own accounting (`Comm.stats`)."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm

    def totals(self) -> tuple[int, float]:
        return self.comm.stats.total_calls(), self.comm.stats.total_bytes()


class DTensorCollectives(PhaseCollectives, TorchDispatchMode):
    """The functional collectives DTensor issues (forward, backward and optimizer), counted the way
    meshtron's Comm counts its own: per-rank ring volume."""

    def __init__(self, world: int):
        PhaseCollectives.__init__(self)
        TorchDispatchMode.__init__(self)
        self.n, self.bytes, self.calls = world, 0.0, 0

    def totals(self) -> tuple[int, float]:
        return self.calls, self.bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor dispatch first: the collectives it runs inside come back here on local tensors.
            return NotImplemented
        name = func._opname if func.namespace == "_c10d_functional" else ""
        if name.startswith(("all_", "reduce", "broadcast")):  # not wait_tensor or autograd wrappers
            nbytes = args[0].numel() * args[0].element_size()
            share = (self.n - 1) / self.n
            volume = {
                "all_reduce": 2 * nbytes * share,
                "all_gather_into_tensor": nbytes * self.n * share,
                "reduce_scatter_tensor": nbytes * share,
                "all_to_all_single": nbytes * share,
            }
            if name not in volume:
                raise NotImplementedError(f"uncounted collective {func}")
            self.bytes += volume[name]
            self.calls += 1
        return func(*args, **kwargs)


def counted_step(runner: Runner, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """An untimed step that counts collectives by phase (torch's through a dispatch mode, which slows
    every op, hence not a timed step), and notes where torch's embedding gradient lives."""
    if runner.comm is not None:
        observer: PhaseCollectives = CommCollectives(runner.comm)
        record = train_step(runner, inputs, targets, observer=observer)
        embedding_grad = None
    else:
        observer = DTensorCollectives(dist.get_world_size())
        with observer:
            record = train_step(runner, inputs, targets, observer=observer, keep_grads=True)
        grad = runner.model.tok_embeddings.weight.grad
        embedding_grad = (", ".join(map(repr, grad.placements)), tuple(grad.to_local().shape))
        runner.optimizer.zero_grad()
    return {"loss": record.loss, "by_phase": observer.by_phase, "embedding_grad": embedding_grad}


def profiled_step(
    runner: Runner, inputs: torch.Tensor, targets: torch.Tensor, op_table: bool
) -> tuple[StepRecord, str]:
    """An untimed step under the profiler: allocation peak, state bytes, op table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        record = train_step(runner, inputs, targets, measure_state=True)
    record.alloc_peak = allocation_peak(prof)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) if op_table else ""
    return record, table


def reference_losses(shape: Shape, seed: int) -> list[float]:
    """Losses of steps 1 and 2 of the unsharded model on one device (one AdamW step in between)."""
    model = build_model(shape.model_config(), seed=seed)
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for step in range(2):
        inputs, targets = batch(shape, seed, step)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / targets.numel()
        losses.append(float(loss.detach()))
        if step == 0:
            loss.backward()
            optimizer.step()
    return losses


def bench_rank(
    shape: Shape,
    seed: int,
    warmup: int,
    steps: int,
    sps: Sequence[bool],
    impls: Sequence[str],
    op_tables: bool,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    mesh = ParallelMesh(ParallelDims(tp=tp), "cpu")
    cfg = shape.model_config()
    reference = reference_losses(shape, seed)
    runners = [
        meshtron_runner(cfg, seed, mesh, sp)
        if impl == "meshtron"
        else torch_runner(cfg, seed, mesh, sp, impl)
        for sp in sps
        for impl in impls
    ]
    records: dict[str, list[StepRecord]] = {r.name: [] for r in runners}
    for round_ in range(warmup + steps):
        inputs, targets = batch(shape, seed, round_)
        shift = round_ % len(runners)  # rotate who goes first, so no one always follows the same peer
        for runner in runners[shift:] + runners[:shift]:
            records[runner.name].append(train_step(runner, inputs, targets))
    inputs, targets = batch(shape, seed, warmup + steps)
    counted = {runner.name: counted_step(runner, inputs, targets) for runner in runners}
    inputs, targets = batch(shape, seed, warmup + steps + 1)
    profiled, tables = {}, {}
    for runner in runners:
        profiled[runner.name], tables[runner.name] = profiled_step(runner, inputs, targets, op_tables)
    return {
        "reference": reference,
        "n_params": sum(p.numel() for p in build_model(cfg, seed=seed).parameters()),
        "records": {name: [(r.phases, r.loss, r.comm_bytes) for r in recs] for name, recs in records.items()},
        "counted": counted,
        "profiled": {name: (r.state, r.alloc_peak, r.loss) for name, r in profiled.items()},
        "tables": tables if dist.get_rank() == 0 else {},
        "warmup": warmup,
    }


# -- what the parent makes of every rank's results --


@dataclass
class Summary:
    name: str
    tp: int
    sp: bool
    impl: str
    steps: list[float]  # slowest rank's step time per timed step (s)
    phases: dict[str, list[float]]  # mean over ranks per timed step (s)
    losses: list[float]  # every step: warmup, timed, counted, profiled
    reference: list[float]  # single-device losses of steps 1 and 2
    comm_bytes: float  # meshtron: median over timed steps; torch: the counted step
    collectives: dict[str, list[float]]  # phase -> [calls, bytes] in the counted step
    embedding_grad: tuple[str, tuple[int, ...]] | None  # torch: placements and local shape
    state: dict[str, int] = field(default_factory=dict)  # the largest rank's
    alloc_peak: int = 0  # the largest rank's

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    def phase_median(self, phase: str) -> float:
        return statistics.median(self.phases[phase])

    def calls(self, phase: str | None = None) -> int:
        phases = PHASES if phase is None else (phase,)
        return int(sum(self.collectives.get(p, [0, 0.0])[0] for p in phases))


def summarise(tp: int, results: list[dict[str, Any]]) -> list[Summary]:
    warmup = results[0]["warmup"]
    out = []
    for name in results[0]["records"]:
        per_rank = [r["records"][name][warmup:] for r in results]
        n_steps = len(per_rank[0])
        steps = [max(sum(rank[i][0].values()) for rank in per_rank) for i in range(n_steps)]
        phases = {
            p: [statistics.fmean(rank[i][0].get(p, 0.0) for rank in per_rank) for i in range(n_steps)]
            for p in PHASES
        }
        impl = name.split()[0]
        counted = results[0]["counted"][name]  # every rank of a tp group runs the same collectives
        profiled = [r["profiled"][name] for r in results]
        if impl == "meshtron":
            comm_bytes = statistics.median(rec[2] for rec in per_rank[0])
        else:
            comm_bytes = sum(b for _, b in counted["by_phase"].values())
        losses = [rec[1] for rec in results[0]["records"][name]] + [counted["loss"], profiled[0][2]]
        out.append(
            Summary(
                name=name,
                tp=tp,
                sp=name.endswith("+sp"),
                impl=impl,
                steps=steps,
                phases=phases,
                losses=losses,
                reference=results[0]["reference"],
                comm_bytes=comm_bytes,
                collectives=counted["by_phase"],
                embedding_grad=counted["embedding_grad"],
                state=max((p[0] for p in profiled), key=lambda s: sum(s.values())),
                alloc_peak=max(p[1] for p in profiled),
            )
        )
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def checks(s: Summary, peer: Summary | None) -> tuple[float, float, bool]:
    """(worst relative difference to the single-device losses of steps 1-2, worst to meshtron's losses
    at any step, ok)."""
    vs_ref = max(rel(a, b) for a, b in zip(s.losses[:2], s.reference, strict=False))
    vs_peer = max(rel(a, b) for a, b in zip(s.losses, peer.losses, strict=True)) if peer is not None else 0.0
    return vs_ref, vs_peer, vs_ref <= LOSS_RTOL and vs_peer <= LOSS_RTOL


def sp_text(s: Summary) -> str:
    return "yes" if s.sp else "no"


def meshtron_of(summaries: list[Summary], s: Summary) -> Summary | None:
    """meshtron with the same tp and sp as the torch variant `s` (None for meshtron itself)."""
    if s.impl == "meshtron":
        return None
    return next((o for o in summaries if o.tp == s.tp and o.sp == s.sp and o.impl == "meshtron"), None)


def paired_ratio(ours: Summary, ref: Summary) -> float:
    """Median over rounds of meshtron's step / the torch step of the same round (robust to drift)."""
    return statistics.median(a / b for a, b in zip(ours.steps, ref.steps, strict=True))


TABLE_HEADER = (
    "| tp | sp | implementation | median step ms | p10 ms | p90 ms | ratio meshtron / this "
    "| state MiB per rank (params / grads / optim) | peak step allocations MiB "
    "| comm MiB per step per rank (collectives) |"
)
TABLE_RULE = "|---:|---|---|---:|---:|---:|---:|---|---:|---:|"
PHASE_HEADER = (
    "| tp | sp | implementation | forward + loss ms | backward ms | optimizer + zero_grad ms "
    "| collectives forward / backward / optimizer | comm MiB forward / backward / optimizer |"
)
PHASE_RULE = "|---:|---|---|---:|---:|---:|---:|---:|"


def table_rows(summaries: list[Summary]) -> list[str]:
    rows = []
    for s in summaries:
        ours = meshtron_of(summaries, s)
        ratio = f"**{ours.median / s.median:.3f}**" if ours else ""
        state = f"{mib(sum(s.state.values()))} ({' / '.join(mib(v) for v in s.state.values())})"
        rows.append(
            f"| {s.tp} | {sp_text(s)} | {s.impl} | {ms(s.median)} | {ms(quantile(s.steps, 0.1))} "
            f"| {ms(quantile(s.steps, 0.9))} | {ratio} | {state} | {mib(s.alloc_peak)} "
            f"| {mib(s.comm_bytes)} ({s.calls()}) |"
        )
    return rows


def phase_rows(summaries: list[Summary]) -> list[str]:
    rows = []
    for s in summaries:
        times = " | ".join(ms(s.phase_median(p)) for p in PHASES)
        calls = " / ".join(str(s.calls(p)) for p in PHASES)
        volume = " / ".join(mib(s.collectives.get(p, [0, 0.0])[1]) for p in PHASES)
        rows.append(f"| {s.tp} | {sp_text(s)} | {s.impl} | {times} | {calls} | {volume} |")
    return rows


def check_lines(summaries: list[Summary]) -> list[str]:
    lines = []
    for s in summaries:
        ours = meshtron_of(summaries, s)
        vs_ref, vs_ours, ok = checks(s, ours)
        line = (
            f"- tp={s.tp} {s.name}: step-1 loss {s.losses[0]:.6f} (single device {s.reference[0]:.6f}), "
            f"step-2 loss {s.losses[1]:.6f} (single device {s.reference[1]:.6f}); worst relative "
            f"difference to single device {vs_ref:.1e}"
        )
        if ours is not None:
            line += (
                f", to meshtron over all {len(s.losses)} steps {vs_ours:.1e}; per-round ratio "
                f"meshtron/{s.impl} median {paired_ratio(ours, s):.3f}"
            )
        lines.append(line + (" (ok)" if ok else f" (FAILED, tolerance {LOSS_RTOL:.0e})"))
    return lines


def phase_deltas(s: Summary, ref: Summary) -> dict[str, float]:
    return {p: (s.phase_median(p) - ref.phase_median(p)) * 1e3 for p in PHASES}


def delta_text(s: Summary, ref: Summary) -> str:
    return ", ".join(f"{p} {d:+.1f} ms" for p, d in phase_deltas(s, ref).items())


def command_text(argv: Sequence[str]) -> str:
    return " ".join(["python", "benchmarks/tensor_parallel.py", *argv])


def findings_text(summaries: list[Summary]) -> str:
    """What limits the numbers: this run's phase differences and collective counts, around the
    mechanisms found by counting collectives per phase, profiling (`--profile`) and reading both sides'
    code. Paragraphs whose variants did not run are left out."""
    by_key = {(s.tp, s.sp, s.impl): s for s in summaries}
    tps = sorted({s.tp for s in summaries})

    def get(tp: int, sp: bool, impl: str) -> Summary | None:
        return by_key.get((tp, sp, impl))

    def phase_mib(s: Summary, phase: str) -> str:
        return mib(s.collectives.get(phase, [0, 0.0])[1])

    lines = [
        "### What limits the numbers",
        "",
        "Phase differences are meshtron minus torch (median ms; negative: meshtron faster); collective "
        "counts and per-rank volumes are those of the phase table.",
        "",
    ]
    for s in summaries:
        ours = meshtron_of(summaries, s)
        if ours is not None:
            lines.append(
                f"- tp={s.tp}, {'tp+sp' if s.sp else 'tp'}, vs {s.impl}: ratio {ours.median / s.median:.3f}; "
                f"{delta_text(ours, s)}"
            )
    lines.append("")
    t = tps[0]
    m, tt, ts = get(t, False, "meshtron"), get(t, False, "torch"), get(t, False, "torch-shared")
    m_sp, tt_sp = get(t, True, "meshtron"), get(t, True, "torch")
    if m and tt:
        text = (
            "- **Backward: one reduction per projection in torchtitan's plan.** Each ColwiseParallel "
            "projection (wq, wk, wv; w1, w3) is handed a plain tensor and wraps it into a Replicate DTensor "
            "on its own, so in backward each projection's input gradient (a Partial DTensor) is all-reduced "
            f"on its own: at tp={t} without sp {tt.calls('backward')} backward collectives "
            f"({phase_mib(tt, 'backward')} MiB per rank) where meshtron, which enters the tensor-parallel "
            "region once per attention / feed-forward block, lets autograd sum the projections' input "
            f"gradients locally and reduces once: {m.calls('backward')} ({phase_mib(m, 'backward')} MiB)."
        )
        if m_sp and tt_sp:
            text += (
                " Under sp, torchtitan's PrepareModuleInput hands the projections a plain tensor too, so the "
                "five all-reduces per layer stay (the result is then sliced back to the local sequence): "
                f"{tt_sp.calls('backward')} backward collectives ({phase_mib(tt_sp, 'backward')} MiB) against "
                f"meshtron's {m_sp.calls('backward')} ({phase_mib(m_sp, 'backward')} MiB: per layer two "
                "reduce-scatters where torch has five all-reduces, then the all-gathers both sides run, and "
                "one tiny all-reduce per norm weight)."
            )
        if ts:
            text += (
                " `torch-shared` changes only that: attention's and the feed-forward's input becomes one "
                "Replicate DTensor (`PrepareModuleInput(..., use_local_output=False)`) that the projections "
                f"share, and torch's backward drops to meshtron's collectives ({ts.calls('backward')}, "
                f"{phase_mib(ts, 'backward')} MiB); its losses match too. What remains of the gap is "
                "explained below."
            )
        lines.append(text)
    if m_sp and tt_sp:
        deltas = ", ".join(
            f"{(get(tp, True, 'torch').phase_median('optimizer') - get(tp, True, 'meshtron').phase_median('optimizer')) * 1e3:+.1f} ms at tp={tp}"
            for tp in tps
            if get(tp, True, "torch") and get(tp, True, "meshtron")
        )
        lines.append(
            "- **Optimizer under sp (torch).** SequenceParallel leaves the norm weights' gradients as "
            "Partial(sum) DTensors; the foreach AdamW ops redistribute such a gradient every time they read "
            f"it, so every `optimizer.step()` runs {tt_sp.calls('optimizer')} all-reduces of one norm "
            f"weight each (three per norm weight). They move {phase_mib(tt_sp, 'optimizer')} MiB, but each "
            "is a synchronisation point of all ranks: the torch optimizer phase is longer by "
            f"{deltas}, the most where the ranks are oversubscribed. meshtron's gradient hooks all-reduce "
            "each norm weight's gradient once, in backward."
        )
    if tt and tt.embedding_grad and m:
        placements, shape = tt.embedding_grad
        extra = ", ".join(
            f"{mib(get(tp, False, 'torch').state['grads'] - get(tp, False, 'meshtron').state['grads'])} MiB "
            f"at tp={tp}"
            for tp in tps
            if get(tp, False, "torch") and get(tp, False, "meshtron")
        )
        lines.append(
            "- **Embedding gradient (torch).** DTensor's sharding rule for the embedding backward makes the "
            f"gradient of the Shard(0) table a {placements} tensor of the whole vocabulary, {shape} on "
            "every rank; AdamW then reads only the local rows. That is a dense embedding backward over the "
            f"whole table on every rank, and more gradient memory per rank ({extra}; the grads part of the "
            "state column). meshtron's VocabParallelEmbedding has the gradient of its own rows only."
        )
    if m and tt:
        lines.append(
            "- **Forward.** Both sides run the same forward collectives (without sp "
            f"{m.calls('forward')} vs {tt.calls('forward')}"
            + (f", with sp {m_sp.calls('forward')} vs {tt_sp.calls('forward')}" if m_sp and tt_sp else "")
            + ", with the same volume) and the same matmul and attention kernels, so the forward gap is "
            "most likely CPU work around them (this benchmark does not break it down further): DTensor wraps and unwraps tensors at every "
            "parallel layer and runs sharding propagation in Python for the ops on DTensors (the head's "
            "`F.linear`, loss_parallel's log-softmax and NLL, the sp norms), where meshtron runs plain "
            "modules on local tensors and calls the collectives from autograd Functions. That overhead does "
            "not shrink as tp grows, so it weighs more at larger tp."
        )
    if m and m_sp:
        sp_times = ", ".join(
            f"tp={tp} {ms(get(tp, True, 'meshtron').median)} vs {ms(get(tp, False, 'meshtron').median)} ms"
            for tp in tps
            if get(tp, True, "meshtron") and get(tp, False, "meshtron")
        )
        memory = ", ".join(
            f"tp={tp} {mib(get(tp, True, 'meshtron').alloc_peak)} vs {mib(get(tp, False, 'meshtron').alloc_peak)}"
            for tp in tps
            if get(tp, True, "meshtron") and get(tp, False, "meshtron")
        )
        lines.append(
            "- **Sequence parallel on gloo (both sides).** sp is slower than plain tp here (meshtron "
            f"{sp_times}; torch likewise): it replaces each all-reduce by an all-gather plus a "
            f"reduce-scatter (meshtron {m_sp.calls()} collectives per step against {m.calls()}), and gloo "
            "has no reduce-scatter of its own: its `_reduce_scatter_base` allocates a copy of the whole input "
            "(1 MiB per call in the profile here) and all-reduces it (see the data-parallel section), so each "
            "reduce-scatter costs a full all-reduce plus a copy. What sp buys is activation memory: meshtron's peak step allocations with sp vs without, "
            f"{memory} MiB. On meshtron's side, the synchronous `Comm.reduce_scatter_tensor` used by sp "
            "goes through that gloo path although its input is already a private contiguous copy (from "
            "`movedim(...).contiguous()`), unlike `reduce_scatter_async`, which all-reduces its scratch "
            "buffer in place and saves the clone; `_ReduceFromGroup` (forward) and `_CopyToGroup` (backward) "
            "also clone before all-reducing in place. These copies are 1 MiB activations, a few ms per step "
            "at most here."
        )
    if any(tp > (os.cpu_count() or 1) for tp in tps):
        scaling = ", ".join(
            f"tp={tp} {ms(get(tp, False, 'meshtron').median)} ms" for tp in tps if get(tp, False, "meshtron")
        )
        lines.append(
            f"- **Oversubscription.** {max(tps)} single-threaded ranks share {os.cpu_count()} cores, so every "
            "collective also waits for the OS to schedule the peers, and the larger world does not run "
            f"faster here (meshtron without sp: {scaling}). Each extra collective and each bit of per-rank "
            "CPU work costs more there than with a core per rank, so the ratios of the oversubscribed world "
            "likely overstate what the same differences would give on such a machine."
        )
    return "\n".join(lines)


def section_text(
    summaries: list[Summary],
    shape: Shape,
    n_params: int,
    args: argparse.Namespace,
    argv: Sequence[str],
    wall_s: float,
    findings: str,
) -> str:
    cpus = os.cpu_count()
    tps = sorted({s.tp for s in summaries})
    lines = [
        SECTION_TITLE,
        "",
        "One training step (forward + cross-entropy + backward + `AdamW(lr=3e-4, foreach=True)` step + "
        "zero_grad, no gradient clipping on either side) of the same dense meshtron Llama model (same seed, "
        "same weights) on the same random token batches, tensor parallel over the whole gloo world: "
        "meshtron's `apply_tensor_parallel` + `vocab_parallel_cross_entropy` against PyTorch's "
        "`parallelize_module` (ColwiseParallel wq / wk / wv / w1 / w3, RowwiseParallel wo / w2, "
        "RowwiseParallel(input_layouts=Replicate()) embedding, ColwiseParallel head with Shard(-1) logits "
        "and `loss_parallel()` cross-entropy -- neither side gathers the logits; with sp also "
        "SequenceParallel norms, PrepareModuleInput(Shard(1) -> Replicate) on attention and feed-forward, "
        "Shard(1) outputs of wo / w2 / embedding, as torchtitan does). **torch-shared** is the same plan "
        "except that attention's and the feed-forward's input is one Replicate DTensor shared by their "
        "column-parallel projections (`PrepareModuleInput(..., use_local_output=False)`), so backward reduces "
        "their summed input gradient once, as meshtron does. meshtron's `Transformer` applies its "
        "head as `F.linear(h, output.weight)`, so ColwiseParallel on `output` only shards the weight and its "
        "input conversion is a PrepareModuleOutput(-> Replicate) on the final norm. All "
        "implementations of a world live in every rank, each with its own model copy and optimizer, and "
        "take turns step by step after warmup, the order rotating every round; a barrier precedes every "
        "step. **step** = the slowest rank's time. **ratio** = median meshtron step / median step of that "
        "torch implementation with the same tp and sp (< 1: meshtron faster). **state** = params + grads + optimizer state of "
        "the largest rank, counted once per tensor storage (DTensors by their local tensor) after the "
        "optimizer step. **peak step allocations** = peak of bytes allocated minus freed during one step, "
        "from `torch.profiler(profile_memory=True)`. **comm** = per-rank ring volume: meshtron's "
        "`comm.stats.total_bytes()` per step (median); torch's counted in one extra step by a dispatch mode "
        "on DTensor's functional collectives, the same way (forward, backward and optimizer). gloo runs every "
        "reduce-scatter as an all-reduce, so sp's reduce-scatters really move twice their counted bytes "
        "on both sides.",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- CPU: {cpu_model()} ({cpus} logical CPUs, shared with other jobs); every rank "
        f"`torch.set_num_threads(1)`; worlds of {' and '.join(map(str, tps))} ranks on {cpus} cores: "
        + ", ".join(f"tp={t} is {'oversubscribed' if t > (cpus or 1) else 'one rank per core'}" for t in tps)
        + " (an oversubscribed rank waits for the OS to schedule its peers at every collective, so absolute "
        "times are noisy)",
        f"- model: {shape.text()}; {n_params / 1e6:.2f}M parameters, fp32, dense",
        f"- {args.steps} timed steps per implementation after {args.warmup} warmup, plus one counted and one "
        "profiled step; "
        f"run took {wall_s:.0f} s",
        f"- reproduce: `{command_text(argv)}`",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *table_rows(summaries),
        "",
        "Median ms per phase (mean over ranks), and the collectives of each phase in the counted step "
        "(calls, and per-rank ring volume):",
        "",
        PHASE_HEADER,
        PHASE_RULE,
        *phase_rows(summaries),
        "",
        "Checks (losses of steps 1 and 2 against an unsharded single-device model with the same AdamW "
        "step; every torch variant against meshtron at every step, warmup, counted and profiled steps "
        "included) and noise (per-round ratio: each timed meshtron step against the torch step of the same "
        "round):",
        "",
        *check_lines(summaries),
        "",
        findings,
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = timed_run_parser(__doc__, "tensor-parallel")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp degrees (one world each)")
    parser.add_argument(
        "--sp", choices=("both", "off", "on"), default="both", help="sequence parallel variants to run"
    )
    parser.add_argument(
        "--torch",
        nargs="+",
        choices=IMPLS[1:],
        default=list(IMPLS[1:]),
        help="torch plans to compare with: torchtitan's, and the same with one shared input DTensor",
    )
    parser.add_argument("--profile", action="store_true", help="print rank 0's op table of the profiled step")
    args = parser.parse_args(argv)
    if args.warmup + args.steps < 2:
        parser.error("--warmup + --steps must be at least 2: steps 1 and 2 are the correctness check")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shape = Shape()
    sps = {"both": (False, True), "off": (False,), "on": (True,)}[args.sp]
    impls = ("meshtron", *args.torch)
    start = time.perf_counter()
    summaries: list[Summary] = []
    n_params = 0
    for tp in args.tp:
        print(f"tp={tp}: {tp} gloo ranks, {shape.text()}; {args.warmup} warmup + {args.steps} timed steps")
        pool = WorkerPool(tp, timeout_s=900)
        try:
            results = pool.run(
                bench_rank, shape, args.seed, args.warmup, args.steps, sps, impls, args.profile
            )
        finally:
            pool.close()
        n_params = results[0]["n_params"]
        if args.profile:
            for name, table in results[0]["tables"].items():
                print(f"\n== tp={tp} {name} (rank 0, profiled step) ==\n{table}")
        summaries += summarise(tp, results)
    wall_s = time.perf_counter() - start
    findings = findings_text(summaries)
    print("\n".join(["", TABLE_HEADER, TABLE_RULE, *table_rows(summaries), ""]))
    print("\n".join([PHASE_HEADER, PHASE_RULE, *phase_rows(summaries), ""]))
    print("\n".join([*check_lines(summaries), "", findings]))
    print(f"\nwall time {wall_s:.0f} s")
    failed = [f"tp={s.tp} {s.name}" for s in summaries if not checks(s, meshtron_of(summaries, s))[2]]
    if args.out != "-":
        write_results(
            Path(args.out),
            SECTION_TITLE,
            section_text(summaries, shape, n_params, args, argv, wall_s, findings),
        )
        print(f"wrote {args.out}")
    if failed:
        sys.exit(f"loss mismatch beyond {LOSS_RTOL:.0e}: {', '.join(failed)}")


if __name__ == "__main__":
    main()
