"""Benchmark: meshtron's pipeline runtime vs PyTorch's `torch.distributed.pipelining`, 2 gloo ranks on CPU.

One pipeline step (every micro-batch's forward and backward, cross-entropy on the last stage, no
optimizer) of the same Llama model on the same batches, pp=2, for 1F1B (`Schedule1F1B`), interleaved
1F1B with two stages per rank (`ScheduleInterleaved1F1B`) and zero-bubble (meshtron's ZB-H1 vs
`ScheduleInterleavedZeroBubble` with one stage per rank), and the V schedules (`ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`; two stages per rank in a V). Both sides run the same pruned `PipelineChunk`s.
The bubble is measured alike on both sides from each compute action's time, and set against the theory
for equal stages and the bound from compute (`simulate` running each side's own order at its measured
action costs, communication free).
Method and analysis: benchmarks/RESULTS.md. E.g. `python benchmarks/pipeline.py --steps 4 --out -`.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
from harness import Clock, Pair, Runner
from reporting import mib, ms, table
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import SPLIT_BACKWARD, ModelConfig
from meshtron.models.llama import build_model
from meshtron.models.loss import MicroBatchLoss, cross_entropy_per_token
from meshtron.pipeline.chunk import PipelineChunk, keep_rank_chunks
from meshtron.pipeline.runtime import PipelineRuntime
from meshtron.schedules.actions import chunks_of_rank
from meshtron.schedules.build import Simulation, build_schedule, simulate, with_p2p
from meshtron.schedules.split import split_layers

TITLE = "## Pipeline parallel: meshtron vs torch.distributed.pipelining (2 gloo ranks, CPU)"
PP = 2  # one rank per core of this 2-core machine
# Large enough that a chunk's matmuls dominate each action, small enough for a run of minutes on 2 cores.
MODEL = ModelConfig(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024, vocab_size=4096)
SEQ, MICRO_BATCH, MICROBATCHES = 128, 2, 8
TOKENS = SEQ * MICRO_BATCH * MICROBATCHES  # each micro-batch's loss is divided by the step's tokens
SCHEDULE_VPP = {"1f1b": 1, "interleaved": 2, "zero_bubble": 1, "zbv": 2, "dualpipev": 2}
TORCH_SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
ActionTime = tuple[str, int, int, float]  # a compute action: kind F / B / W, chunk, micro-batch, seconds


def pairs_of(schedules: Sequence[str]) -> list[Pair]:
    """Each schedule against torch's; zero-bubble also against both 1F1Bs (checked against meshtron's:
    the split backward must not change a gradient)."""
    pairs = [Pair(f"{s} meshtron", f"{s} torch") for s in schedules]
    if "zero_bubble" in schedules:
        pairs += [Pair("zero_bubble meshtron", "1f1b meshtron")]
        pairs += [Pair(f"zero_bubble {i}", "1f1b torch", check=False) for i in ("meshtron", "torch")]
        # Other placements (other parameters per rank): timed side by side; each is checked against torch's.
        pairs += [
            Pair(f"{v} meshtron", base, check=False)
            for v in ("zbv", "dualpipev")
            for base in ("zero_bubble meshtron", "1f1b meshtron")
            if v in schedules
        ]
    return pairs


def batch_of(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return harness.token_batch(MODEL.vocab_size, MICRO_BATCH * MICROBATCHES, SEQ, seed, step)


def theory_bubble(schedule: str) -> float:
    """Equal stages, free communication, backward = 2 x forward (B = W when split)."""
    vpp, cost_w = SCHEDULE_VPP[schedule], 1.0 if schedule in SPLIT_BACKWARD else 0.0
    return simulate(build_schedule(PP, vpp, MICROBATCHES, schedule), 1.0, 2.0, cost_w, vpp).bubble_fraction


# -- what runs on every rank --


class Pipeline(Runner):
    """One implementation of one schedule on this rank, with its own copy of this rank's chunks."""

    def __init__(self, impl: str, schedule: str, seed: int, pp: CommGroup):
        self.name, self.schedule, self.vpp = f"{schedule} {impl}", schedule, SCHEDULE_VPP[schedule]
        self.layer_split = split_layers(MODEL.n_layers, PP * self.vpp)
        self.chunk_ids = chunks_of_rank(pp.rank, pp.size, self.vpp, schedule)
        self.model = build_model(MODEL, seed=seed)
        keep_rank_chunks(self.model, self.chunk_ids, self.layer_split)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], clock: Clock) -> float:
        self.model.zero_grad(set_to_none=True)
        clock.skip()
        loss = self.run(*batch)
        clock.lap("step")
        clock.notes["actions"] = self.actions()
        clock.notes["grad_bytes"] = sum(p.numel() * p.element_size() for p in self.model.parameters())
        total = torch.tensor(float(loss))
        dist.all_reduce(total)  # only the last stage's share is non-zero
        return float(total)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's forwards and backwards; this rank's share of the mean loss."""
        raise NotImplementedError

    def actions(self) -> list[ActionTime]:
        """The last step's compute actions in order: F (the last stage's includes the loss), B and W."""
        raise NotImplementedError

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters()}


class MeshtronPipeline(Pipeline):
    def __init__(self, schedule: str, seed: int, pp: CommGroup, comm: Comm):
        super().__init__("meshtron", schedule, seed, pp)
        self.runtime = PipelineRuntime(self.model, comm, pp, self.vpp, schedule, self.layer_split)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        micro_batches = list(
            zip(inputs.tensor_split(MICROBATCHES), targets.tensor_split(MICROBATCHES), strict=True)
        )
        return self.runtime.run(
            micro_batches,
            MicroBatchLoss(cross_entropy_per_token, TOKENS, contextlib.nullcontext).for_step(None),
        )

    def actions(self) -> list[ActionTime]:
        return [(a.kind.value, a.chunk, a.mb, end - start) for a, start, end in self.runtime.timeline]


class StageModule(nn.Module):
    """A `PipelineChunk` as torch's stages call it: one tensor in, one out (the chunk's MoE aux loss, zero
    for a dense model, is dropped)."""

    def __init__(self, chunk: PipelineChunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions_BS = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # as meshtron's runtime builds them
        return self.chunk(x, positions_BS)[0]


class TimedStage(PipelineStage):
    """A PipelineStage that appends each F, B and W it runs to `actions` (the schedule has waited for
    the receives before these calls, so the times hold compute only)."""

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
    def __init__(self, schedule: str, seed: int, pp: CommGroup):
        super().__init__("torch", schedule, seed, pp)
        n_stages, self.step_actions = PP * self.vpp, []
        stages = [
            TimedStage(
                StageModule(PipelineChunk(self.model, c, self.layer_split[c], n_stages)),
                c,
                n_stages,
                torch.device("cpu"),
                group=pp.process_group,
                actions=self.step_actions,
            )
            for c in self.chunk_ids
        ]
        # scale_grads=False: the loss is already divided by the global token count, as meshtron's is.
        cls = TORCH_SCHEDULES[schedule]
        stages_arg = stages[0] if cls is Schedule1F1B else stages
        self.pipeline = cls(stages_arg, MICROBATCHES, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        loss = cross_entropy_per_token(logits, targets).sum() / TOKENS
        if self.step_actions:  # not torch's shape inference, at its first step before any action
            # torch computes the loss right after the last stage's forward: it joins that forward's time,
            # as in meshtron's timeline.
            kind, chunk, mb, seconds = self.step_actions[-1]
            assert (kind, chunk) == ("F", PP * self.vpp - 1), self.step_actions[-1]
            self.step_actions[-1] = (kind, chunk, mb, seconds + time.perf_counter() - start)
        return loss

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.step_actions.clear()
        losses: list[torch.Tensor] = []  # filled on the rank of the last stage only
        self.pipeline.step(inputs, target=targets, losses=losses, return_outputs=False)
        return sum((loss.detach() for loss in losses), torch.tensor(0.0))

    def actions(self) -> list[ActionTime]:
        return list(self.step_actions)


def bench_rank(
    seed: int, warmup: int, steps: int, schedules: Sequence[str], op_tables: bool
) -> harness.RankResult:
    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelDims(pp=PP), "cpu")
    comm, pp = Comm(), mesh.group("pp")
    runners: list[Runner] = []
    for s in schedules:
        runners += [MeshtronPipeline(s, seed, pp, comm), TorchPipeline(s, seed, pp)]
    inputs, targets = batch_of(seed, 0)
    with torch.no_grad():  # the whole model's loss on one device
        reference = float(cross_entropy_per_token(build_model(MODEL, seed=seed)(inputs), targets).mean())
    batches, pairs = (lambda step: batch_of(seed, step)), pairs_of(schedules)
    options = {"reference": [reference], "measure": True, "op_tables": op_tables}
    result = harness.run_rounds(runners, batches, pairs, warmup, steps, **options)
    mesh.close()
    return result


# -- what the parent makes of the ranks' results --


def action_costs(s: reporting.Samples) -> dict[tuple[str, int], float]:
    """Per (kind, chunk): the median over timed steps of the step's mean time of that action. Means within
    a step keep the step's compute whole; the median over steps drops the steps other jobs slowed."""
    means: dict[tuple[str, int], list[float]] = {}
    for rank in s.notes:
        for notes in rank:
            step: dict[tuple[str, int], list[float]] = {}
            for kind, chunk, _, seconds in notes["actions"]:
                step.setdefault((kind, chunk), []).append(seconds)
            for key, times in step.items():
                means.setdefault(key, []).append(statistics.fmean(times))
    return {key: statistics.median(values) for key, values in means.items()}


def compute(s: reporting.Samples) -> list[list[float]]:
    """Per rank, the compute seconds of each timed step."""
    return [[sum(a[3] for a in notes["actions"]) for notes in rank] for rank in s.notes]


def bound(s: reporting.Samples) -> Simulation:
    """This implementation's own order on each rank, every action at its measured cost, communication
    free: what the order and the stages' compute alone force."""
    orders = [[a[:3] for a in rank[0]["actions"]] for rank in s.notes]  # the same every step
    schedule = s.name.split()[0]
    vpp = SCHEDULE_VPP[schedule]
    return simulate(
        [with_p2p(o, rank, PP, vpp, schedule) for rank, o in enumerate(orders)], chunk_costs=action_costs(s)
    )


def detail_row(s: reporting.Samples) -> list[str]:
    per_rank, sim = compute(s), bound(s)
    bubble = statistics.fmean(1 - sum(c[i] for c in per_rank) / (PP * t) for i, t in enumerate(s.steps))
    compute_ms = " / ".join(ms(statistics.median(c)) for c in per_rank)
    bubbles = [f"{b:.1%}" for b in (sim.bubble_fraction, bubble, theory_bubble(s.name.split()[0]))]
    return [s.name, *s.timing(), compute_ms, ms(sim.makespan), *bubbles]


def memory_row(s: reporting.Samples) -> list[str]:
    """Per rank, the measured step's peak allocations, and that less the rank's gradients (allocated
    in the step, the same whatever the schedule): what activations and temporaries peaked at."""
    peaks = [m.alloc_peak for m in s.measured]
    grads = [m.notes["grad_bytes"] for m in s.measured]
    activations = [p - g for p, g in zip(peaks, grads, strict=True)]
    return [s.name, " / ".join(mib(p) for p in peaks), " / ".join(mib(a) for a in activations)]


def action_row(s: reporting.Samples) -> list[str]:
    costs, late_w = action_costs(s), []
    chunks = sorted({c for _, c in costs})
    per_kind = [" / ".join(ms(costs[k, c]) if (k, c) in costs else "-" for c in chunks) for k in "FBW"]
    for rank in s.notes:
        kinds = [a[0] for a in rank[0]["actions"]]
        last_b = max(i for i, k in enumerate(kinds) if k == "B")
        late_w.append(str(kinds[last_b:].count("W")))
    return [s.name, *per_kind, " / ".join(late_w)]


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__)
    parser.add_argument("--schedules", nargs="+", choices=tuple(SCHEDULE_VPP), default=list(SCHEDULE_VPP))
    args = parser.parse_args(argv)
    if "zero_bubble" in args.schedules and "1f1b" not in args.schedules:
        parser.error("zero_bubble is checked and compared against 1f1b: list 1f1b too")
    report = reporting.Report(__file__, TITLE)
    results = harness.run_world(
        PP, bench_rank, args.seed, args.warmup, args.steps, args.schedules, args.profile
    )
    samples = report.add(results)
    report.blocks = [
        reporting.comparison_table(report.pairs, samples),
        table(
            "implementation | median step ms | p10 ms | p90 ms | compute ms per step, rank 0 / rank 1 "
            "| step bound from compute ms | bubble at the bound | measured bubble | theory (equal stages)",
            [detail_row(s) for s in samples.values()],
            "Steps (the slowest rank's wall time of `run` / `schedule.step`) and bubbles:",
        ),
        table(
            "implementation | peak step allocations MiB, rank 0 / rank 1 | less the gradients",
            [memory_row(s) for s in samples.values()],
            "Peak allocations of the measured step (`torch.profiler` allocation events, from zeroed "
            "gradients; the rank's gradients are allocated in it too, so the second column is activations "
            "and temporaries):",
        ),
        table(
            "implementation | F ms per chunk | B ms per chunk | W ms per chunk | W after the last B, per rank",
            [action_row(s) for s in samples.values()],
            "Median ms of one action per chunk (chunk 0 / 1 / ...; the last stage's F includes the loss), "
            "and how many W each rank's order runs after its last B:",
        ),
    ]
    report.facts = [
        f"{PP} ranks x `torch.set_num_threads(1)` (OMP_NUM_THREADS=1), one rank per core",
        f"model: {reporting.model_text(MODEL)}, seq {SEQ}, untied head; {MICROBATCHES} micro-batches of "
        f"{MICRO_BATCH} sequences; fp32; layers split evenly over the pp x vpp chunks (`split_layers`)",
        f"{args.steps} timed steps per implementation after the check step and {args.warmup} warmup",
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
