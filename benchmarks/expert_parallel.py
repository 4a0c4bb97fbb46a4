"""Benchmark: meshtron's expert parallel, all-to-all vs all-gather dispatch, against the same MoE model with
its experts replicated (ep = 1, plain data parallel), 4 gloo ranks on CPU (fp32).

Every layout runs the full training step of `meshtron train` (Trainer.step: forward, loss, backward,
gradient reduction, clipping, AdamW) on the same batches with the same ZeRO stage over the same 4
data-parallel ranks; the layouts differ only in where the experts live and how tokens reach them. Before
anything is timed, the check steps' losses must agree and so must every gradient after them (at its
shape before expert parallel: the ep ranks' experts stacked), which catches a gradient scaled by ep.
After the check steps the weights are frozen (AdamW still runs, at learning rate 0), and the losses of
every later step, on new batches, must agree too. Training on would make them drift apart: top-k routing
is discontinuous, and the layouts sum an expert's gradient in different orders (one grouped matmul over
the ep group's tokens vs per-rank partial sums reduced over dp), so after a dozen steps one near-tied
assignment flips and the runs part at the 1e-3 level (seen here: within 1.4e-7 up to step 13, the first
flipped assignment at step 14, 1.5e-3 apart by step 26).
Reported: step time, the expert weights each rank holds and its whole training state, the dispatch
traffic over the ep group (counted by `Comm`) against the formula of docs/expert-parallel.md under
balanced routing (every rank's tokens spread evenly over the experts, forced for one untimed step after
the timed ones) and as the learned router left it, and the share of the step spent inside the
dispatcher's exchanges: the dispatcher's `Comm` is swapped for one that times each collective call, in
forward and (through the autograd rules, which call back the comm they were applied with) in backward.
That time includes waiting for the slowest peer of the ep group, so it is also set against the same
exchanges run back to back with nothing between them. PyTorch's own token-exchange primitive
(torch.ops.symm_mem.all_to_all_vdev) is tried on CPU tensors; the reason it cannot run here is reported
as it is raised. Method and analysis: benchmarks/RESULTS.md. E.g. `python benchmarks/expert_parallel.py`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
from harness import Clock, Pair, Runner
from reporting import mib, ms, table

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.comm.record import CommStats
from meshtron.config.schema import Config
from meshtron.models.moe import MoE, Router
from meshtron.observe.metrics import model_state_bytes
from meshtron.parallel.expert import AllGatherDispatch, AllToAllDispatch, expert_parameter_names
from meshtron.rules.checks import load_config
from meshtron.train.trainer import Trainer

TITLE = "## Expert parallel: all-to-all vs all-gather dispatch vs replicated experts (4 gloo ranks, CPU)"
WORLD = 4
MODEL = [
    *harness.MOE_MODEL,
    "--training.global_batch=8",
    "--training.micro_batch=1",
    "--training.warmup_steps=2",
    "--training.steps=1000",
    "--run.plot=false",
    f"--parallel.dp_shard={WORLD}",
    "--parallel.zero=1",
]
REPLICATED = "ep=1 (experts replicated)"
LAYOUTS = {
    "ep=4 alltoall": ["--parallel.ep=4", "--parallel.ep_dispatch=alltoall"],
    "ep=4 allgather": ["--parallel.ep=4", "--parallel.ep_dispatch=allgather"],
    REPLICATED: [],
}
OPS = ("all_gather", "all_to_all", "reduce_scatter")  # what the dispatchers call on the ep group
PAIRS = [
    Pair("ep=4 alltoall", REPLICATED),
    Pair("ep=4 allgather", REPLICATED),
    Pair("ep=4 alltoall", "ep=4 allgather"),
]


def config(name: str, run_dir: str) -> Config:
    slug = name.split(" (")[0].replace("=", "").replace(" ", "-")
    return load_config(None, [*MODEL, *LAYOUTS[name], f"--run.dir={run_dir}/{slug}"])


class TeeStats(CommStats):
    """Counts the dispatcher's collectives by (group, op) and passes each on to the trainer's accounting:
    the stats its Comm counts in now (a step's recording swaps them in and out)."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm

    def record(self, group: str, op: str, nbytes: float, issued: bool = True, calls: int = 1) -> None:
        self.bytes[(group, op)] += nbytes  # here without any side effects of the main accounting's record
        self.calls[(group, op)] += calls
        self.comm.stats.record(group, op, nbytes, issued, calls)


class TimedComm(Comm):
    """The trainer's Comm (its deadline, its accounting) with a stopwatch on the raw collectives the
    dispatchers call. The autograd rules keep the comm they were applied with, so the backward's
    exchanges go through here too."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.timeout, self.stats = comm.timeout, TeeStats(comm)
        self.seconds: dict[str, float] = defaultdict(float)

    def _timed(self, op: str, run: Any, *args: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = run(*args)
        self.seconds[op] += time.perf_counter() - start
        return out

    def all_gather_tensor(self, x: torch.Tensor, group: CommGroup, dim: int = 0) -> torch.Tensor:
        return self._timed("all_gather", super().all_gather_tensor, x, group, dim)

    def reduce_scatter_tensor(
        self, x: torch.Tensor, group: CommGroup, dim: int = 0, consume: bool = False
    ) -> torch.Tensor:
        return self._timed("reduce_scatter", super().reduce_scatter_tensor, x, group, dim, consume)

    def all_to_all_single(
        self, x: torch.Tensor, group: CommGroup, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        return self._timed("all_to_all", super().all_to_all_single, x, group, output_splits, input_splits)

    def take(self) -> tuple[dict[str, float], dict[tuple[str, str], float], dict[tuple[str, str], int]]:
        """(seconds per op, bytes and calls per (group, op)) since the last take; resets them."""
        out = dict(self.seconds), dict(self.stats.bytes), dict(self.stats.calls)
        self.seconds.clear()
        self.stats.reset()
        return out


def balanced_routing(router: Router) -> None:
    """Make `router` send token t to experts (t*k + j) mod E, j < k: every expert gets T*k/E of each rank's
    T tokens, so every ep rank receives T*k/ep rows from every rank (the gate weights stay the router's
    scores of those experts, so backward still reaches the router)."""
    route = router.forward

    def forward(x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        _, _, scores_TE, logits_TE = route(x_TD)
        n_tokens, n_experts = scores_TE.shape
        experts_Tk = (torch.arange(n_tokens)[:, None] * router.top_k + torch.arange(router.top_k)) % n_experts
        weights_Tk = scores_TE.gather(1, experts_Tk)
        if router.norm_topk:
            weights_Tk = weights_Tk / weights_Tk.sum(-1, keepdim=True)
        return weights_Tk * router.scale, experts_Tk, scores_TE, logits_TE

    router.forward = forward


class TrainerStep(Runner):
    """meshtron's training step for one layout; the batches come from its own sampler (the same for all).
    During the check steps it keeps the step's gradients (gathered to their pre-parallel shapes) for the
    parity check; in the measured step it records the training state before the gradients are zeroed."""

    def __init__(self, name: str, cfg: Config):
        dims = cfg.parallel.dims(dist.get_world_size())
        self.name, self.trainer, self.step_index = name, Trainer(cfg, ParallelMesh(dims, "cpu")), 0
        self.moes = [m for m in self.trainer.model.modules() if isinstance(m, MoE)]
        self.timed: TimedComm | None = None
        dispatch = self.moes[0].dispatch
        if isinstance(dispatch, AllToAllDispatch | AllGatherDispatch):
            self.timed = dispatch.comm = TimedComm(dispatch.comm)  # one dispatcher serves every layer
        self.keep_grads, self.kept, self.clock = False, None, None
        engine = self.trainer.engine
        zero_grad = engine.zero_grad

        def zero_grad_after_looking() -> None:
            if self.keep_grads:
                self.kept = engine.full_gradients(self.trainer.comm)
            if self.clock is not None and self.clock.measure:
                self.clock.notes.update(self.snapshot())
            zero_grad()

        engine.zero_grad = zero_grad_after_looking

    def freeze(self) -> None:
        """From now on every step runs in full (AdamW included) at learning rate 0, so the weights stay
        those after the check steps (see the module docstring for why)."""
        harness.freeze_at_zero_lr(self.trainer.optimizer)

    def step(self, batch: Any, clock: Clock) -> float:
        self.clock = clock
        start = time.perf_counter()
        row = self.trainer.step(self.step_index)
        clock.lap("step")
        seconds, nbytes, calls = self.timed.take() if self.timed else ({}, {}, {})
        clock.notes.update(
            step_s=time.perf_counter() - start,
            dispatch_s=seconds,
            dispatch_bytes=nbytes,
            dispatch_calls=calls,
            comm=row["comm_bytes_by_group"],
        )
        self.step_index += 1
        return row["loss"]

    def grads(self) -> dict[str, torch.Tensor] | None:
        return self.kept

    def snapshot(self) -> dict[str, Any]:
        experts = expert_parameter_names(self.trainer.model)
        held = sum(
            p.numel() * p.element_size() for n, p in self.trainer.model.named_parameters() if n in experts
        )
        return {"experts": held, "state": model_state_bytes(self.trainer.engine, self.trainer.optimizer)}


def exchanges_alone(runner: TrainerStep, repeats: int = 3) -> float:
    """Seconds of one step's dispatch exchanges (forward and backward, every MoE layer and micro-batch,
    the shapes of balanced routing) run back to back with no compute between them."""
    comm, cfg = runner.timed, runner.trainer.cfg
    ep = runner.moes[0].dispatch.ep
    n, m, t = ep.size, cfg.model, cfg.training
    tokens = t.micro_batch * t.seq_len
    rows = tokens * m.top_k // n  # to each rank, from each rank
    calls = len(runner.moes) * t.global_batch // (t.micro_batch * WORLD)
    x_TD, gathered, rows_MD = (
        torch.randn(tokens, m.dim),
        torch.randn(n * tokens, m.dim),
        torch.randn(n * rows, m.dim),
    )
    counts = torch.zeros(m.n_experts, dtype=torch.int64)
    gates, ids, keep = (
        torch.randn(tokens, m.top_k),
        torch.zeros(tokens, m.top_k, dtype=torch.int64),
        torch.zeros(tokens, m.top_k, dtype=torch.uint8),
    )
    gates_gathered = torch.randn(n * tokens, m.top_k)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            if cfg.parallel.ep_dispatch == "alltoall":
                comm.all_gather_tensor(counts, ep)
                for _ in range(4):  # dispatch and combine, forward and backward
                    comm.all_to_all_single(rows_MD, ep, [rows] * n, [rows] * n)
            else:
                for x in (x_TD, gates, ids, keep):
                    comm.all_gather_tensor(x, ep)
                comm.reduce_scatter_tensor(gathered, ep)  # the outputs
                comm.all_gather_tensor(x_TD, ep)  # their gradient
                comm.reduce_scatter_tensor(gathered, ep)  # the tokens' gradient
                comm.reduce_scatter_tensor(gates_gathered, ep)  # the gate weights'
        times.append(time.perf_counter() - start)
    comm.take()
    return statistics.median(times)


def balanced_step(runner: TrainerStep) -> dict[tuple[str, str], float]:
    """One more (untimed) step with balanced routing in every MoE layer: the dispatch bytes it counted."""
    for moe in runner.moes:
        balanced_routing(moe.router)
    runner.trainer.step(runner.step_index)
    return runner.timed.take()[1] if runner.timed else {}


def torch_token_exchange_error() -> str:
    """PyTorch's token exchange for expert parallel (the op torchtitan's dispatch builds on) on CPU
    tensors of this gloo world; '' if it runs."""
    world = dist.get_world_size()
    rows = torch.randn(2 * world, 16)
    out = torch.empty(4 * world, 16)
    splits = torch.full((world,), 2, dtype=torch.int64)
    splits_offsets = torch.empty(2, world, dtype=torch.int64)
    try:
        torch.ops.symm_mem.all_to_all_vdev(rows, out, splits, splits_offsets, dist.group.WORLD.group_name)
    except Exception as err:  # noqa: BLE001 - whatever it raises is the finding
        messages = []
        while err is not None:
            first = str(err).strip().splitlines()[0]
            messages.append(f"{type(err).__name__}: {first.split('. ')[0]}")
            err = err.__context__
        return " <- ".join(reversed(messages))
    return ""


def bench_rank(names: Sequence[str], warmup: int, steps: int, check_steps: int) -> harness.RankResult:
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="meshtron-bench-ep-")
    runners = [TrainerStep(name, config(name, run_dir)) for name in names]
    for r in runners:
        r.keep_grads = True
    pairs = [p for p in PAIRS if {p.ours, p.peer} <= set(names)]

    def batch_of(i: int) -> None:  # each trainer draws its own batches; after the checks: frozen weights
        if i == check_steps:
            for r in runners:
                r.keep_grads, r.kept = False, None
                r.freeze()

    result = harness.run_rounds(runners, batch_of, pairs, warmup, steps, check_steps=check_steps)
    result.extra["alone_s"] = {r.name: exchanges_alone(r) for r in runners if r.timed}
    result.extra["balanced"] = {r.name: balanced_step(r) for r in runners if r.timed}
    result.extra["torch_ep"] = torch_token_exchange_error()
    return result


# -- what the parent makes of the results --


def formula_bytes(name: str) -> dict[str, float]:
    """Dispatch bytes per rank per step over ep under balanced routing, by op
    (docs/expert-parallel.md#communication): T tokens per micro-batch, M micro-batches per rank, L MoE
    layers, fp32 rows of D, counted as `Comm` counts (what this rank sends; a gather or reduce-scatter
    (n-1)/n of the full tensor)."""
    cfg = config(name, ".")
    m, t, p = cfg.model, cfg.training, cfg.parallel
    n, k, d = p.ep, m.top_k, m.dim
    if n == 1:
        return {}
    tokens = t.micro_batch * t.seq_len
    times = m.n_layers * t.global_batch // (t.micro_batch * WORLD)  # MoE layer forwards per rank per step
    if p.ep_dispatch == "alltoall":  # rows out, rows back, the same two in backward, the rows' gate values
        # (fp32) out and their gradient back; the counts table
        return {
            "all_to_all": times * (4 * tokens * k * d * 4 + 2 * tokens * k * 4) * (n - 1) / n,
            "all_gather": times * m.n_experts * 8 * (n - 1),
        }
    # Tokens, their gradient; gate weights (fp32), expert ids (int64), keep mask (uint8): gathered.
    # Outputs (fp32), the tokens' gradient, the gate weights' gradient: reduce-scattered.
    return {
        "all_gather": times * (2 * tokens * d * 4 + tokens * k * (4 + 8 + 1)) * (n - 1),
        "reduce_scatter": times * (2 * tokens * d * 4 + tokens * k * 4) * (n - 1),
    }


def dispatch_columns(s: reporting.Samples, extra: dict) -> list[str]:
    """Balanced routing: measured / formula MiB; learned routing (the measured step); exchange ms per
    step in the step / alone; their share of the step."""
    formula = formula_bytes(s.name)
    if not formula:
        return ["", "", "", ""]
    balanced = sum(v for (g, _), v in extra["balanced"][s.name].items() if g == "ep")
    learned = statistics.fmean(
        sum(v for (g, _), v in m.notes["dispatch_bytes"].items() if g == "ep") for m in s.measured
    )
    in_step = [sum(n["dispatch_s"].values()) for rank in s.notes for n in rank]
    shares = [sum(n["dispatch_s"].values()) / n["step_s"] for rank in s.notes for n in rank]
    return [
        f"{mib(balanced)} / {mib(sum(formula.values()))}",
        mib(learned),
        f"{ms(statistics.median(in_step))} / {ms(extra['alone_s'][s.name])}",
        f"{100 * statistics.median(shares):.1f}%",
    ]


def traffic(s: reporting.Samples) -> str:
    """Rank 0's counted bytes of the measured step, all groups: total (each group)."""
    comm = {g: b for g, b in s.measured[0].notes["comm"].items() if b}
    return f"{mib(sum(comm.values()))} ({', '.join(f'{g} {mib(b)}' for g, b in sorted(comm.items()))})"


def tables(names: Sequence[str], samples: dict[str, reporting.Samples], extra: dict) -> list[list[str]]:
    single = samples[REPLICATED]
    rows = []
    for name in names:
        s = samples[name]
        experts = max(m.notes["experts"] for m in s.measured)
        rows.append(
            [
                name,
                *s.timing(),
                f"{single.median / s.median:.2f}x" if name != REPLICATED else "1",
                mib(experts),
                s.state,
                mib(s.alloc_peak),
                traffic(s),
                *dispatch_columns(s, extra),
            ]
        )
    layouts = table(
        "layout | median step ms | p10 ms | p90 ms | speed vs ep=1 | expert weights held MiB per rank "
        "| training state MiB per rank: total (params / grads / optimizer) | peak step allocations MiB "
        "| all traffic MiB per rank per step: total (by group) "
        "| dispatch MiB per rank per step, balanced routing: measured / formula "
        "| dispatch MiB, learned routing (mean over ranks) | dispatch exchanges ms per step: in the step / alone "
        "| share of the step in dispatch exchanges",
        rows,
        "Steps (the slowest rank's), memory per rank (measured step), dispatch traffic and time per rank:",
    )
    ops, times = [], []
    for name in names:
        formula = formula_bytes(name)
        if not formula:
            continue
        measured = extra["balanced"].get(name, {})
        for op in sorted(formula):
            ops.append([name, op, f"{measured.get(('ep', op), 0.0):,.0f}", f"{formula[op]:,.0f}"])
        by_op = defaultdict(list)
        for rank in samples[name].notes:
            for n in rank:
                for op in OPS:
                    by_op[op].append(n["dispatch_s"].get(op, 0.0))
        times.append([name, *(ms(statistics.median(by_op[op])) if formula.get(op) else "" for op in OPS)])
    per_op = table(
        "layout | collective on group ep | measured bytes per rank per step | formula bytes",
        ops,
        "Dispatch traffic by collective, balanced routing (one untimed step after the timed ones):",
    )
    per_op_time = table(
        " | ".join(["layout", *(f"{op} ms per step" for op in OPS)]),
        times,
        "Time inside the dispatcher's collectives per step, by collective (median over ranks and timed steps):",
    )
    return [layouts, per_op, per_op_time, reporting.comparison_table(PAIRS, samples)]


def main(argv: Sequence[str] | None = None) -> None:
    names = list(LAYOUTS)
    report = reporting.Report(__file__, TITLE)  # started now: the run's time includes the layouts'
    args, results = reporting.run_named_layouts(__doc__, WORLD, bench_rank, names, argv)
    samples = report.add(results)
    report.blocks += tables(names, samples, results[0].extra)
    cfg = config(REPLICATED, ".")
    m, t = cfg.model, cfg.training
    cpus = os.cpu_count() or 1
    torch_ep = results[0].extra["torch_ep"]
    report.facts = [
        f"every rank `torch.set_num_threads(1)`; {WORLD} ranks on {cpus} logical CPUs"
        + (
            " (oversubscribed: a rank waits for the OS to schedule its peers at every exchange)"
            if cpus < WORLD
            else ""
        ),
        f"model: {reporting.model_text(m)}, {m.n_experts} experts (SwiGLU, ffn {m.expert_ffn_dim}), top-{m.top_k}, "
        f"softmax router, dropless, aux loss {m.aux_loss_coef}; every layer MoE",
        f"seq {t.seq_len}, {t.global_batch} sequences per step, micro-batch {t.micro_batch}: "
        f"{t.global_batch // (t.micro_batch * WORLD)} micro-batches per rank; fp32; ZeRO-1 over the {WORLD} ranks "
        "for the dense parameters in every layout and for the experts at ep=1 (at ep=4 each rank's experts "
        "have edp = 1 rank: plain, unsharded)",
        f"{args.steps} timed steps per layout after {args.check_steps} check steps and {args.warmup} warmup, "
        "plus one measured step and one balanced-routing step; the weights are frozen after the check steps "
        "(AdamW at learning rate 0), so every later loss is checked too",
        "PyTorch's token exchange (`torch.ops.symm_mem.all_to_all_vdev`) on this CPU: "
        + (f"fails, `{torch_ep}`" if torch_ep else "runs (not yet compared here)"),
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
