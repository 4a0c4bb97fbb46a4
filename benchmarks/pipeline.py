"""Benchmark: meshtron's pipeline-parallel runtime vs PyTorch's `torch.distributed.pipelining`, 2 gloo
ranks on CPU (fp32).

What is measured: the wall time of one pipeline step -- the forwards and backwards of every micro-batch,
cross-entropy loss on the last stage, no optimizer -- of the same Llama model on the same token batches,
pp=2, for three schedules:

  * 1F1B: meshtron's `PipelineRuntime(schedule="1f1b")` vs torch's `Schedule1F1B` (one stage per rank);
  * interleaved 1F1B, vpp=2: meshtron's `PipelineRuntime(schedule="interleaved", vpp=2)` vs torch's
    `ScheduleInterleaved1F1B` (two stages per rank, stage i on rank i % pp on both sides);
  * zero-bubble (backward split into B, the input gradient, and W, the weight gradients, run later):
    meshtron's `PipelineRuntime(schedule="zero_bubble")` (ZB-H1) vs torch's
    `ScheduleInterleavedZeroBubble` given one stage per rank, its only zero-bubble schedule that takes
    that placement (`ScheduleZBVZeroBubble` and `ScheduleDualPipeV` need two stages per rank, V-shaped).
    The two orders differ (see the notes), and so do the splits: meshtron's W recomputes the linear
    layers' weight gradients from recorded inputs and output gradients, torch's runs autograd again
    from the graph that B kept.

Both sides run the same modules: each builds the model with `build_model(cfg, seed)` and prunes it to
this rank's chunks with `keep_rank_chunks`; meshtron wraps the chunks in its `PipelineChunk`s, torch's
`PipelineStage`s wrap the same `PipelineChunk`s (behind a module that returns the activations, or the
logits on the last stage, without the MoE aux loss, which is zero for a dense model). The loss is the
same on both sides: per micro-batch, `cross_entropy_per_token(logits, targets).sum() / global_tokens`
(meshtron's runtime does this itself; torch gets it as `loss_fn` with `scale_grads=False`), so the sum
over micro-batches is the mean over the global batch and neither side rescales gradients afterwards.

How:
  * one 2-rank gloo world (`meshtron.testing.workers.WorkerPool`, one thread per rank), the layers split evenly
    over the pp * vpp chunks (`split_layers`); the embedding is on rank 0, the final norm, head and
    loss on rank 1 (they weigh as much as a fraction of a layer, so rank 1 carries more work on both
    sides);
  * every implementation lives in every rank with its own model copy; the token batches are random,
    drawn from (seed, step), and split into micro-batches the same way (`tensor_split` on dim 0);
  * correctness, before any timing: after one step from the same weights on the same batch, the loss
    and every parameter gradient of each torch pipeline must match meshtron's, and meshtron's
    zero-bubble must match its 1F1B, to `RTOL` (relative), and the loss must match the whole model's
    loss on one device; otherwise the run stops and writes nothing;
  * then `--warmup` untimed steps each, and `--steps` timed steps each with the implementations taking
    turns (the order rotates every round) so that machine noise hits all alike; gradients are zeroed
    (set to None) before each step, outside the timing, and a barrier precedes every step. A rank's
    step time is the wall time of `PipelineRuntime.run` / `schedule.step`; the step time is the
    slowest rank's;
  * bubble, measured the same way on both sides from per-action compute times: meshtron's from
    `PipelineRuntime.timeline` (every F, B and W; the last stage's F includes the loss), torch's by
    timing `PipelineStage.forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk` (a
    subclass) and the loss function (which torch's schedules call right after the last stage's
    forward). Per step, bubble = 1 - sum over ranks of compute time / (pp x step time): the idle share
    of the ranks, waiting on receives, schedule overhead and imbalance included; reported as the mean
    over timed steps next to the theory for equal stages and free communication ((p-1)/(m+p-1) for
    1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 with F = B = W), and next to the bound
    from compute: the simulator (`meshtron.pipeline.schedules.simulate`) running each
    implementation's own order of actions with their measured median costs and free communication,
    which separates what the order and the stages' imbalance force from what the runtime adds.

Run `python benchmarks/pipeline.py` (writes its section of benchmarks/RESULTS.md), or e.g.
`python benchmarks/pipeline.py --steps 4 --warmup 1 --out -`.
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
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import ModelShape, cpu_model, median_ci, ms, quantile, timed_run_parser, write_results
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from meshtron.comm import Comm, CommGroup
from meshtron.config import ModelConfig
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import Transformer, build_model, cross_entropy_per_token
from meshtron.pipeline.runtime import Losses, PipelineChunk, PipelineRuntime, keep_rank_chunks
from meshtron.pipeline.schedules import Simulation, build_schedule, simulate, with_p2p
from meshtron.pipeline.split import chunks_of_rank, split_layers
from meshtron.testing.workers import WorkerPool

SECTION_TITLE = "## Pipeline parallel: meshtron vs torch.distributed.pipelining (2 gloo ranks, CPU)"
PP = 2  # one rank per core of this 2-core machine
RTOL = 1e-5
SCHEDULE_VPP = {"1f1b": 1, "interleaved": 2, "zero_bubble": 1}
# A compute action of one step on one rank: (kind F / B / W, chunk, micro-batch, seconds).
ActionTime = tuple[str, int, int, float]


@dataclass(frozen=True)
class Shape(ModelShape):
    # Large enough that a chunk's matmuls dominate each action (a 4-layer chunk's F+B of one
    # micro-batch is ~100 ms single-threaded), small enough for a run of a few minutes on 2 cores.
    dim: int = 384
    layers: int = 8
    heads: int = 6
    kv_heads: int = 2
    ffn: int = 1024
    micro_batch: int = 2
    microbatches: int = 8

    @property
    def batch(self) -> int:
        return self.micro_batch * self.microbatches

    @property
    def global_tokens(self) -> int:
        return self.batch * self.seq

    def text(self) -> str:
        return (
            f"{self.model_text()}, untied head; {self.microbatches} micro-batches of {self.micro_batch} "
            f"sequences ({self.batch} per step)"
        )


def theory_bubble(schedule: str, microbatches: int) -> float:
    """Idle share of equal stages with free communication, backward = 2 x forward, split into B = W
    when the schedule splits it: (p-1)/(m+p-1) for 1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1)
    for ZB-H1."""
    vpp = SCHEDULE_VPP[schedule]
    cost_w = 1.0 if schedule == "zero_bubble" else 0.0
    return simulate(build_schedule(PP, vpp, microbatches, schedule), 1.0, 2.0, cost_w, vpp).bubble_fraction


def batch(shape: Shape, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets [batch, seq] of `step`, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- what runs on every rank --


class Pipeline:
    """One implementation of one schedule on this rank: its own pruned model copy."""

    impl: str
    schedule: str
    model: Transformer

    @property
    def name(self) -> str:
        return f"{self.schedule} {self.impl}"

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
        """One step's forwards and backwards; this rank's share of the mean loss (0 off the last stage)."""
        raise NotImplementedError

    def actions(self) -> list[ActionTime]:
        """The compute actions of the last step in the order they ran: F (the last stage's includes the
        loss), B (the whole backward, or its input-gradient part when the schedule splits it) and W."""
        raise NotImplementedError


def pruned_model(
    cfg: ModelConfig, seed: int, pp: CommGroup, vpp: int, layer_split: list[list[int]]
) -> Transformer:
    model = build_model(cfg, seed=seed)
    keep_rank_chunks(model, chunks_of_rank(pp.rank, pp.size, vpp), layer_split)
    return model


class MeshtronPipeline(Pipeline):
    def __init__(
        self, shape: Shape, seed: int, comm: Comm, pp: CommGroup, schedule: str, layer_split: list[list[int]]
    ):
        self.impl, self.schedule, self.shape = "meshtron", schedule, shape
        vpp = SCHEDULE_VPP[schedule]
        self.model = pruned_model(shape.model_config(), seed, pp, vpp, layer_split)
        self.runtime = PipelineRuntime(self.model, comm, pp, vpp, schedule, layer_split)

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
        m = self.shape.microbatches
        micro_batches = list(zip(inputs_BS.tensor_split(m), targets_BS.tensor_split(m), strict=True))
        losses = Losses(cross_entropy_per_token, self.shape.global_tokens, contextlib.nullcontext)
        loss = self.runtime.run(micro_batches, losses)
        return float(loss)

    def actions(self) -> list[ActionTime]:
        return [(a.kind, a.chunk, a.mb, end - start) for a, start, end in self.runtime.timeline]


class StageModule(nn.Module):
    """A `PipelineChunk` as torch's stages call it: one tensor in, one tensor out (the chunk's aux loss,
    zero for a dense model, is dropped so that only the activations travel)."""

    def __init__(self, chunk: PipelineChunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        positions_BS = torch.arange(seq).expand(batch, -1)  # as meshtron's runtime builds them
        out, _ = self.chunk(x, positions_BS)
        return out


class TimedStage(PipelineStage):
    """A PipelineStage that appends each forward (F), backward or input-gradient backward (B) and
    weight-gradient backward (W) to `actions`. Receives are waited on by the schedule before these
    calls, so the times hold compute only."""

    def __init__(self, *args: Any, actions: list[ActionTime], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.actions = actions

    def _timed(self, kind: str, mb: int, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = run(mb, *args, **kwargs)
        self.actions.append((kind, self.stage_index, mb, time.perf_counter() - start))
        return out

    # torch's schedules pass the micro-batch index first, positionally.
    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", mb, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self._timed("B", mb, super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self._timed("W", mb, super().backward_weight_one_chunk, *args, **kwargs)


class TorchPipeline(Pipeline):
    def __init__(self, shape: Shape, seed: int, pp: CommGroup, schedule: str, layer_split: list[list[int]]):
        self.impl, self.schedule, self.shape = "torch", schedule, shape
        vpp = SCHEDULE_VPP[schedule]
        n_stages = pp.size * vpp
        self.model = pruned_model(shape.model_config(), seed, pp, vpp, layer_split)
        self.last_stage = n_stages - 1
        self.step_actions: list[ActionTime] = []
        stages = [
            TimedStage(
                StageModule(PipelineChunk(self.model, c, layer_split[c], n_stages)),
                c,
                n_stages,
                torch.device("cpu"),
                group=pp.process_group,
                actions=self.step_actions,
            )
            for c in chunks_of_rank(pp.rank, pp.size, vpp)
        ]
        m = shape.microbatches
        # scale_grads=False: the loss is already divided by the global token count, as meshtron's is.
        if schedule == "1f1b":
            self.pipeline = Schedule1F1B(stages[0], m, loss_fn=self.loss, scale_grads=False)
        elif schedule == "interleaved":
            self.pipeline = ScheduleInterleaved1F1B(stages, m, loss_fn=self.loss, scale_grads=False)
        else:
            self.pipeline = ScheduleInterleavedZeroBubble(stages, m, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        loss = cross_entropy_per_token(logits, targets).sum() / self.shape.global_tokens
        if not self.step_actions:  # torch's shape inference, at its first step before any action
            return loss
        # torch's schedules compute the loss right after the last stage's forward: it joins that
        # forward's time, as in meshtron's timeline.
        kind, chunk, mb, seconds = self.step_actions[-1]
        assert (kind, chunk) == ("F", self.last_stage), self.step_actions[-1]
        self.step_actions[-1] = (kind, chunk, mb, seconds + time.perf_counter() - start)
        return loss

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
        self.step_actions.clear()
        losses: list[torch.Tensor] = []  # filled on the rank of the last stage only
        # Every rank passes both: torch uses the inputs on the first stage, the targets on the last.
        self.pipeline.step(inputs_BS, target=targets_BS, losses=losses, return_outputs=False)
        return float(sum(loss.detach() for loss in losses))

    def actions(self) -> list[ActionTime]:
        return list(self.step_actions)


def reference_loss(shape: Shape, seed: int, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
    """The whole model's mean cross-entropy on one device."""
    with torch.no_grad():
        logits = build_model(shape.model_config(), seed=seed)(inputs_BS)
        return float(cross_entropy_per_token(logits, targets_BS).mean())


def gradient_difference(ours: Pipeline, theirs: Pipeline) -> tuple[float, str, int]:
    """(worst over parameters of |g_ours - g_theirs| / |g_theirs| (Frobenius), its parameter, parameters)."""
    worst, worst_name = 0.0, ""
    theirs_params = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        other = theirs_params[name].grad
        if param.grad is None or other is None:
            raise RuntimeError(f"{name}: no gradient in {(ours if param.grad is None else theirs).name}")
        diff = float((param.grad - other).norm() / other.norm())
        if diff >= worst:
            worst, worst_name = diff, name
    return worst, worst_name, len(theirs_params)


def comparisons(schedules: Sequence[str]) -> list[tuple[str, str, str]]:
    """The check's (label, pipeline, reference): each schedule's torch pipeline against meshtron's, and
    meshtron's zero-bubble against its 1F1B (the split backward must not change a gradient)."""
    pairs = [(s, f"{s} meshtron", f"{s} torch") for s in schedules]
    if "zero_bubble" in schedules:
        pairs.append(("zero_bubble vs 1f1b", "zero_bubble meshtron", "1f1b meshtron"))
    return pairs


def timed_step(
    pipeline: Pipeline, inputs_BS: torch.Tensor, targets_BS: torch.Tensor
) -> tuple[float, list[ActionTime], float]:
    """(step seconds, compute actions, loss share) of one step on this rank."""
    pipeline.model.zero_grad(set_to_none=True)
    dist.barrier()  # every rank starts together, so the step time is not another rank's leftover
    start = time.perf_counter()
    loss = pipeline.step(inputs_BS, targets_BS)
    return time.perf_counter() - start, pipeline.actions(), loss


def bench_rank(shape: Shape, seed: int, warmup: int, steps: int, schedules: Sequence[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelDims(pp=PP), "cpu")
    comm, pp = Comm(), mesh.group("pp")
    pipelines: list[Pipeline] = []
    for schedule in schedules:
        layer_split = split_layers(shape.layers, PP * SCHEDULE_VPP[schedule])
        pipelines.append(MeshtronPipeline(shape, seed, comm, pp, schedule, layer_split))
        pipelines.append(TorchPipeline(shape, seed, pp, schedule, layer_split))

    # The check step: every pipeline from the same weights on the same batch, before any timing.
    inputs, targets = batch(shape, seed, 0)
    check: dict[str, Any] = {"reference": reference_loss(shape, seed, inputs, targets)}
    by_name = {p.name: p for p in pipelines}
    losses = {p.name: timed_step(p, inputs, targets)[2] for p in pipelines}
    labels = comparisons(schedules)
    for label, ours, theirs in labels:
        check[label] = {
            "loss": (losses[ours], losses[theirs]),
            "grad": gradient_difference(by_name[ours], by_name[theirs]),
        }
    # Every rank must agree to go on: a rank that stopped alone would leave the other in a collective.
    holds_loss = pp.rank == pp.size - 1
    local_bad = any(
        check[label]["grad"][0] > RTOL
        or rel(*check[label]["loss"]) > RTOL
        or (holds_loss and rel(check[label]["loss"][0], check["reference"]) > RTOL)
        for label, _, _ in labels
    )
    bad = torch.tensor(float(local_bad))
    comm.all_reduce_(bad, pp)
    if bad.item():
        mesh.close()
        return {"check": check, "records": None}

    records: dict[str, list[tuple[float, list[ActionTime], float]]] = {p.name: [] for p in pipelines}
    for round_ in range(warmup + steps):
        inputs, targets = batch(shape, seed, 1 + round_)
        shift = round_ % len(pipelines)  # rotate who goes first, so no one always follows the same peer
        for p in pipelines[shift:] + pipelines[:shift]:
            records[p.name].append(timed_step(p, inputs, targets))
    mesh.close()
    return {"check": check, "records": {name: recs[warmup:] for name, recs in records.items()}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)  # ranks off the last stage hold loss 0 on both sides


# -- what the parent makes of every rank's results --


@dataclass
class Summary:
    schedule: str
    impl: str
    steps: list[float]  # slowest rank's step time per timed step (s)
    compute: list[list[float]]  # per rank, compute seconds per timed step
    order: list[list[tuple[str, int, int]]]  # per rank, the (kind, chunk, micro-batch) it ran, in order
    costs: dict[tuple[str, int], float]  # per (kind, chunk), an action's time (s): see `action_costs`
    microbatches: int

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def compute_medians(self) -> list[float]:
        return [statistics.median(rank) for rank in self.compute]

    @property
    def bubble(self) -> float:
        """Mean over timed steps of the ranks' idle share of the step."""
        return statistics.fmean(
            1 - sum(rank[i] for rank in self.compute) / (len(self.compute) * step)
            for i, step in enumerate(self.steps)
        )

    @cached_property
    def simulated(self) -> Simulation:
        """This implementation's own order on each rank, every action taking its measured cost and
        communication taking none: what the order and the stages' compute alone force."""
        vpp = SCHEDULE_VPP[self.schedule]
        # The schedules' own helper, so that a recorded order gets its receives and sends where
        # meshtron's lists have them: each receive right before the compute that needs it, each send
        # right after the compute that makes it.
        schedule = [with_p2p(order, rank, PP, vpp) for rank, order in enumerate(self.order)]
        return simulate(schedule, chunk_costs=self.costs)

    @property
    def bound(self) -> float:
        return self.simulated.makespan

    @property
    def bound_bubble(self) -> float:
        return self.simulated.bubble_fraction


def action_costs(per_rank: list[list[tuple[float, list[ActionTime], float]]]) -> dict[tuple[str, int], float]:
    """Per (kind, chunk): the median over timed steps of the step's mean time of that action. Means
    within a step keep the step's compute whole (a median over single actions would drop the slow ones
    that every step has); the median over steps drops the steps that other jobs slowed."""
    means: dict[tuple[str, int], list[float]] = {}
    for rank in per_rank:
        for _, actions, _ in rank:
            step: dict[tuple[str, int], list[float]] = {}
            for kind, chunk, _, seconds in actions:
                step.setdefault((kind, chunk), []).append(seconds)
            for key, times in step.items():
                means.setdefault(key, []).append(statistics.fmean(times))
    return {key: statistics.median(values) for key, values in means.items()}


def summarise(results: list[dict[str, Any]], shape: Shape) -> dict[tuple[str, str], Summary]:
    out = {}
    for name in results[0]["records"]:
        schedule, impl = name.split()
        per_rank = [r["records"][name] for r in results]
        steps = [max(rank[i][0] for rank in per_rank) for i in range(len(per_rank[0]))]
        compute = [[sum(a[3] for a in rec[1]) for rec in rank] for rank in per_rank]
        order = [[a[:3] for a in rank[0][1]] for rank in per_rank]  # the same every step
        costs = action_costs(per_rank)
        out[(schedule, impl)] = Summary(schedule, impl, steps, compute, order, costs, shape.microbatches)
    return out


def check_lines(results: list[dict[str, Any]], schedules: Sequence[str]) -> tuple[list[str], bool]:
    """One line per comparison (losses summed over ranks: only the last stage's is non-zero), and ok."""
    lines, ok = [], True
    reference = results[0]["check"]["reference"]
    for label, ours_name, theirs_name in comparisons(schedules):
        ours = sum(r["check"][label]["loss"][0] for r in results)
        theirs = sum(r["check"][label]["loss"][1] for r in results)
        worst_rank = max(results, key=lambda r: r["check"][label]["grad"][0])
        grad, name, _ = worst_rank["check"][label]["grad"]
        count = sum(r["check"][label]["grad"][2] for r in results)
        loss_diff, ref_diff = rel(ours, theirs), rel(ours, reference)
        good = loss_diff <= RTOL and ref_diff <= RTOL and grad <= RTOL
        ok = ok and good
        lines.append(
            f"- {label}: loss {ours:.6f} ({ours_name}) vs {theirs:.6f} ({theirs_name}), relative difference "
            f"{loss_diff:.1e}; whole model on one device {reference:.6f} ({ref_diff:.1e}); gradients of "
            f"all {count} parameter tensors, worst relative difference {grad:.1e} (`{name}`)"
            + (" (ok)" if good else f" (FAILED, tolerance {RTOL:.0e})")
        )
    return lines, ok


def pair_ratio(ours: Summary, theirs: Summary) -> str:
    """Median and 95% CI of our step / their step of the same round (robust to drift)."""
    pairs = [a / b for a, b in zip(ours.steps, theirs.steps, strict=True)]
    lo, hi = median_ci(pairs)
    return f"{statistics.median(pairs):.3f} ({lo:.3f}-{hi:.3f})"


TABLE_HEADER = (
    "| schedule | meshtron median step ms | torch median step ms | ratio | per-round ratio (95% CI) "
    "| measured bubble meshtron | measured bubble torch | theory |"
)
TABLE_RULE = "|---|---:|---:|---:|---:|---:|---:|---:|"
DETAIL_HEADER = (
    "| schedule | implementation | median step ms | p10 ms | p90 ms | compute ms per step, rank 0 / rank 1 "
    "| step bound from compute ms | bubble at the bound | measured bubble |"
)
DETAIL_RULE = "|---|---|---:|---:|---:|---:|---:|---:|---:|"


def schedule_label(schedule: str) -> str:
    vpp = SCHEDULE_VPP[schedule]
    return f"{schedule} (pp={PP}" + (f", vpp={vpp})" if vpp > 1 else ")")


def table_rows(summaries: dict[tuple[str, str], Summary], schedules: Sequence[str]) -> list[str]:
    rows = []
    for schedule in schedules:
        ours, theirs = summaries[(schedule, "meshtron")], summaries[(schedule, "torch")]
        theory = theory_bubble(schedule, ours.microbatches)
        rows.append(
            f"| {schedule_label(schedule)} | {ms(ours.median)} | {ms(theirs.median)} "
            f"| **{ours.median / theirs.median:.3f}** | {pair_ratio(ours, theirs)} "
            f"| {ours.bubble:.1%} | {theirs.bubble:.1%} | {theory:.1%} |"
        )
    return rows


def detail_rows(summaries: dict[tuple[str, str], Summary]) -> list[str]:
    return [
        f"| {schedule_label(s.schedule)} | {s.impl} | {ms(s.median)} | {ms(quantile(s.steps, 0.1))} "
        f"| {ms(quantile(s.steps, 0.9))} | {' / '.join(ms(c) for c in s.compute_medians)} "
        f"| {ms(s.bound)} | {s.bound_bubble:.1%} | {s.bubble:.1%} |"
        for s in summaries.values()
    ]


def notes_lines(
    summaries: dict[tuple[str, str], Summary], shape: Shape, schedules: Sequence[str]
) -> list[str]:
    """What this run says beyond the tables, and what is not like-for-like."""
    lines = []
    for schedule in schedules:
        ours, theirs = summaries[(schedule, "meshtron")], summaries[(schedule, "torch")]
        over = "; ".join(
            f"{s.impl} {ms(s.median - s.bound)} ms ({(s.median - s.bound) / s.bound:.1%}), compute "
            f"{ms(sum(s.compute_medians))} ms over both ranks"
            for s in (ours, theirs)
        )
        lines.append(
            f"- {schedule}: its order and the measured compute alone force a bubble of "
            f"{ours.bound_bubble:.1%} (meshtron) / {theirs.bound_bubble:.1%} (torch), against "
            f"{theory_bubble(schedule, ours.microbatches):.1%} for equal stages. Median step above the "
            f"bound from its own compute (p2p, schedule overhead, noise): {over}."
        )
    if {"1f1b", "interleaved"} <= set(schedules):
        one, inter = summaries[("1f1b", "meshtron")], summaries[("interleaved", "meshtron")]
        lines.append(
            "- Interleaving halves the ramp in theory, but rank 1 is the bottleneck (it carries the head "
            "and loss) and is busy for the same compute either way, so only the ramp can shrink, at twice "
            f"the messages: meshtron interleaved {ms(inter.median)} ms vs 1F1B {ms(one.median)} ms."
        )
    if "zero_bubble" in schedules:
        lines += zero_bubble_notes(summaries)
    message_kib = shape.micro_batch * shape.seq * shape.dim * 4 / 2**10
    lines += [
        "- p2p is not like-for-like: meshtron's runtime posts each send without waiting (settling it when "
        "a later message proves it received, or at the end of the step) and posts each receive as soon as "
        "the previous one has arrived; torch's `Schedule1F1B` batches each send with the next receive and "
        "waits on both, and `ScheduleInterleaved1F1B` and `ScheduleInterleavedZeroBubble` (one runtime) "
        "post receives ahead of the compute. A message is "
        "one micro-batch's "
        f"activations or their gradient (fp32 [{shape.micro_batch}, {shape.seq}, {shape.dim}], "
        f"{message_kib:.0f} KiB), cheap between two processes on one machine, so these choices show up "
        "as overhead, not transfer time.",
        "- torch's stages infer shapes at their first step (a metadata exchange, an extra forward and an "
        "input-gradient backward); that falls in the untimed check step. torch's stage wrapper drops the "
        "chunk's MoE aux loss, zero for this dense model (meshtron's runtime adds 0 x aux to the loss).",
        "- The 2 cores are shared with other jobs whose load comes and goes (see the p10-p90 spread): "
        "read the per-round ratio and its interval rather than single medians, and rerun before "
        "trusting a difference of a few percent.",
    ]
    return lines


def zero_bubble_notes(summaries: dict[tuple[str, str], Summary]) -> list[str]:
    """What the split backward buys here: zero-bubble against both 1F1Bs, and why (compute, order)."""
    zb, one = summaries[("zero_bubble", "meshtron")], summaries[("1f1b", "meshtron")]
    torch_zb, torch_one = summaries[("zero_bubble", "torch")], summaries[("1f1b", "torch")]

    def late_w(s: Summary) -> str:
        """Per rank, how many W its order runs after its last B."""
        counts = []
        for order in s.order:
            last_b = max(i for i, (kind, _, _) in enumerate(order) if kind == "B")
            counts.append(sum(kind == "W" for kind, _, _ in order[last_b + 1 :]))
        return " / ".join(map(str, counts))

    def chunk0(s: Summary) -> str:
        return f"B {ms(s.costs['B', 0])} ms, W {ms(s.costs['W', 0])} ms"

    return [
        f"- zero_bubble against 1F1B (per-round ratios, 95% CI): meshtron's ZB-H1 ({ms(zb.median)} ms) "
        f"takes {pair_ratio(zb, one)} x meshtron's 1F1B and {pair_ratio(zb, torch_one)} x torch's "
        f"`Schedule1F1B`; torch's zero-bubble ({ms(torch_zb.median)} ms) {pair_ratio(torch_zb, torch_one)} "
        f"x `Schedule1F1B`. Bounds from compute: meshtron {ms(zb.bound)} ms zero-bubble vs {ms(one.bound)} "
        f"ms 1F1B, torch {ms(torch_zb.bound)} vs {ms(torch_one.bound)} ms.",
        f"- Where the time goes. The split's own cost: compute over both ranks, zero-bubble vs 1F1B, "
        f"meshtron {ms(sum(zb.compute_medians))} vs {ms(sum(one.compute_medians))} ms, torch "
        f"{ms(sum(torch_zb.compute_medians))} vs {ms(sum(torch_one.compute_medians))} ms. Rank 0 holds "
        "the first stage, which has no input gradient to hurry: meshtron runs its whole backward as B and "
        "leaves W empty, torch as W after an empty B (per micro-batch, meshtron "
        f"{chunk0(zb)}; torch {chunk0(torch_zb)}). W run after each rank's last B, rank 0 / rank 1: "
        f"meshtron {late_w(zb)}, torch {late_w(torch_zb)} (meshtron's order lets at most pp - 1 W wait).",
        "- torch 2.13 has no schedule named ZB-H1. `ScheduleInterleavedZeroBubble` (ZB1P in its docstring, "
        "written for several stages per rank) accepts one stage per rank and then runs 1F1B with the "
        "backward split, which is the like-for-like comparison used here. `ScheduleZBVZeroBubble` and "
        "`ScheduleDualPipeV` require exactly two stages per rank in a V (rank 0 holds the first and the "
        "last stage), a different placement and split of the layers, so they are not comparable to a "
        "one-stage-per-rank ZB-H1.",
    ]


def section_text(
    summaries: dict[tuple[str, str], Summary],
    checks: list[str],
    notes: list[str],
    shape: Shape,
    args: argparse.Namespace,
    argv: Sequence[str],
    wall_s: float,
) -> str:
    lines = [
        SECTION_TITLE,
        "",
        "One pipeline step (forwards and backwards of every micro-batch, per-micro-batch cross-entropy on "
        "the last stage; no optimizer) of the same meshtron Llama model (same seed, same weights) on the "
        "same random token batches, pp=2 in one gloo world: meshtron's `PipelineRuntime` against "
        "`torch.distributed.pipelining` (`Schedule1F1B`; `ScheduleInterleaved1F1B` with two stages per "
        "rank; for meshtron's zero-bubble ZB-H1, `ScheduleInterleavedZeroBubble` with one stage per rank, "
        "see the notes). Both prune the model with `keep_rank_chunks` and run the same `PipelineChunk` "
        "modules (torch's `PipelineStage` wraps each in a module that returns only the activations / "
        "logits); both divide each micro-batch's summed cross-entropy by the global token count (torch: "
        "`loss_fn`, `scale_grads=False`). The implementations take turns step by step after warmup, the "
        "order rotating every round; gradients are set to None before each step, outside the timing; a "
        "barrier precedes every step. **step** = the slowest rank's wall time of `run` / `schedule.step`. "
        "**ratio** = median meshtron step / median torch step (< 1: meshtron faster); the **per-round "
        "ratio** pairs each meshtron step with the torch step of the same round, which cancels load that "
        "comes and goes on this shared machine. **measured bubble** = mean over timed steps of 1 - "
        "(compute summed over ranks) / (2 x step), where compute is every forward, backward (B, and W "
        "where split) and loss action, timed the same way on both sides: meshtron's from "
        "`PipelineRuntime.timeline`, torch's by timing `PipelineStage.forward_one_chunk` / "
        "`backward_one_chunk` / `backward_weight_one_chunk` (in a subclass) and the loss function; it counts "
        "all idle time: waits on receives, p2p and schedule overhead, the order and the stages' imbalance. "
        "**theory** = the bubble of equal stages with free communication: (p-1)/(m+p-1) for 1F1B, "
        "(p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 with B = W = F. **step bound from "
        "compute** = `meshtron.pipeline.schedules.simulate` running each implementation's own order of "
        "actions on each rank, every action taking its measured time (per kind and chunk, the median over "
        "timed steps of the step's mean), with free communication; the **bubble at the bound** is the idle "
        "share that the order and the stages' compute alone force. (This replaces the approximation "
        "max(c0, c1 + c0/(m·v)) of earlier runs, which assumed 1F1B-like orders.)",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other jobs); {PP} ranks x "
        "`torch.set_num_threads(1)` (OMP_NUM_THREADS=1), one rank per core",
        f"- model: {shape.text()}; fp32; layers split evenly over the pp x vpp chunks (`split_layers`: "
        "4 + 4 for 1F1B and zero-bubble, 2 per chunk interleaved), so rank 0 also runs the embedding and "
        "rank 1 the final norm, head and loss",
        f"- {args.steps} timed steps per implementation after {args.warmup} warmup and the check step; "
        f"run took {wall_s:.0f} s",
        f"- reproduce: `{' '.join(['python', 'benchmarks/pipeline.py', *argv])}`",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *table_rows(summaries, args.schedules),
        "",
        DETAIL_HEADER,
        DETAIL_RULE,
        *detail_rows(summaries),
        "",
        "Checks (one step from the same weights on the same batch, before timing; losses summed over ranks):",
        "",
        *checks,
        "",
        "Notes:",
        "",
        *notes,
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = timed_run_parser(__doc__, "pipeline")
    parser.add_argument(
        "--schedules", nargs="+", choices=tuple(SCHEDULE_VPP), default=list(SCHEDULE_VPP), help="schedules"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if "zero_bubble" in args.schedules and "1f1b" not in args.schedules:
        parser.error("zero_bubble is checked and compared against 1f1b: list 1f1b too")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shape = Shape()
    print(f"pp={PP}: {PP} gloo ranks, {shape.text()}; {args.warmup} warmup + {args.steps} timed steps")
    start = time.perf_counter()
    pool = WorkerPool(PP, timeout_s=900)
    try:
        results = pool.run(bench_rank, shape, args.seed, args.warmup, args.steps, args.schedules)
    finally:
        pool.close()
    wall_s = time.perf_counter() - start
    checks, ok = check_lines(results, args.schedules)
    print("\n".join(checks))
    if not ok or results[0]["records"] is None:
        sys.exit("correctness check failed (see above): nothing timed, nothing written")
    summaries = summarise(results, shape)
    notes = notes_lines(summaries, shape, args.schedules)
    print("\n".join(["", TABLE_HEADER, TABLE_RULE, *table_rows(summaries, args.schedules), ""]))
    print("\n".join([DETAIL_HEADER, DETAIL_RULE, *detail_rows(summaries), "", *notes]))
    print(f"\nwall time {wall_s:.0f} s")
    if args.out != "-":
        section = section_text(summaries, checks, notes, shape, args, argv, wall_s)
        write_results(Path(args.out), SECTION_TITLE, section)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
