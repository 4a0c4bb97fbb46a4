"""One layout on one cluster: step time (with its breakdown), throughput, MFU and memory per GPU.

A step, on the slowest stage:

  1. per micro-batch and chunk, F, B and W seconds: compute (plan/compute_time.py) plus the tp, cp and
     ep communication compute does not hide (plan/comm_time.py)
  2. the pipeline schedule run on those costs by the simulator (schedules/build.py), with the real
     layer split: its makespan includes the bubble, and it reports each stage's peak in-flight
     micro-batches (the activations memory holds)
  3. plus the data-parallel communication backward does not hide, and the optimizer step (AdamW reads
     and writes about 32 bytes per owned element: parameter, gradient, m, v, and the writes back)

  MFU = model FLOPs per token (plan/flops.py, causal attention counted as half, recompute not counted)
        x tokens per step / (step time x GPUs x dense peak of the compute dtype)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import lru_cache

from meshtron.config.schema import SPLIT_BACKWARD, Config
from meshtron.plan.comm_time import (
    Network,
    Overlap,
    dp_comm,
    ends_comm,
    ep_pieces,
    layer_comm,
    overlapped_ep,
    pp_p2p,
)
from meshtron.plan.compute_time import (
    ComputeEfficiency,
    PassTimes,
    Rates,
    chunk_times,
    expert_times,
    layer_times,
)
from meshtron.plan.flops import keys_per_query, training_flops_per_token
from meshtron.plan.gpu_memory import (
    MemoryOverhead,
    StageBase,
    schedule_activation_bytes,
    stage_base,
    stage_memory,
    stage_total,
)
from meshtron.plan.hardware import Accelerator, PeakDType, peak_flops_per_s
from meshtron.plan.muon import muon_step_time
from meshtron.plan.network import LinkEfficiency
from meshtron.plan.state import layer_split, model_key, stage_signature
from meshtron.rules.data import micro_batches_per_step
from meshtron.schedules.actions import Kind, chunks_of_rank
from meshtron.schedules.build import CheckedSchedule, build_schedule, checked_schedule, simulate
from meshtron.utils.memo import Memo
from meshtron.utils.words import plural

OPTIMIZER_BYTES_PER_ELEMENT = 32


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is for, and the planner's constants for them."""

    gpu: Accelerator
    gpus: int
    dtype: PeakDType = "bf16"
    compute: ComputeEfficiency | None = None  # None: ComputeEfficiency.for_gpu(gpu.name)
    links: LinkEfficiency = field(default_factory=LinkEfficiency)
    overlap: Overlap = field(default_factory=Overlap)
    memory: MemoryOverhead = field(default_factory=MemoryOverhead)
    # How much faster a rank runs while others idle: 1 for devices of their own; CPU ranks sharing
    # cores (probe/hardware.py) run at ranks·threads / cores times their all-busy rate when alone.
    alone_speedup: float = 1.0

    @property
    def peak(self) -> float:
        return peak_flops_per_s(self.gpu, self.dtype)

    def describe(self) -> str:
        g = self.gpu
        if g.name == "cpu":  # a measured machine (probe/hardware.py): said in a CPU's terms
            return (
                f"{plural(self.gpus, 'gloo rank')} on this CPU ({os.cpu_count()} cores; measured fp32 matmul "
                f"{(g.fp32_flops_per_s or self.peak) / 1e9:,.1f} GFLOP/s per rank, "
                f"{g.memory_bytes / 2**30:.1f} GiB of host memory per rank, collectives over loopback "
                f"{g.intra_node_bytes_per_s / 1e9:.2f} GB/s)"
            )
        return (
            f"{self.gpus} x {g.name} ({self.dtype} peak {self.peak / 1e12:,.1f} TFLOP/s, "
            f"{g.memory_bytes / 2**30:.0f} GiB, {g.gpus_per_node} per node, NVLink "
            f"{g.intra_node_bytes_per_s / 1e9:,.0f} GB/s, network {g.inter_node_bytes_per_s / 1e9:,.1f} GB/s "
            "per GPU per direction)"
        )

    def rates(self, training_dtype: str) -> Rates:
        element = 4 if training_dtype == "fp32" else (1 if self.dtype == "fp8" else 2)
        compute = self.compute or ComputeEfficiency.for_gpu(self.gpu.name)
        attention = peak_flops_per_s(self.gpu, "bf16") if self.dtype == "fp8" else self.peak
        if self.dtype == "fp8":
            compute = dataclasses.replace(compute, matmul=compute.matmul_fp8)
        return Rates(
            peak=self.peak,
            hbm=self.gpu.hbm_bytes_per_s,
            eff=compute,
            dtype_bytes=element,
            attention_peak=attention,
        )


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The planner's prediction for one config on one cluster (times in seconds, memory in bytes)."""

    step_time_s: float
    tokens_per_sec_per_gpu: float
    mfu: float
    memory_bytes_per_gpu: float
    memory: dict[str, float]  # the most loaded rank's bytes by part (plan/gpu_memory.py)
    time: dict[str, float]  # the slowest stage's step by part; the parts add up to step_time_s
    bubble_fraction: float  # of the pipeline's makespan, from the simulator
    pipeline_s: float  # forward and backward of every micro-batch, bubble included (the makespan)
    memory_limit_bytes: float  # what one GPU has

    @property
    def fits(self) -> bool:
        return self.memory_bytes_per_gpu <= self.memory_limit_bytes


_DP_KEYS = ("dp_replicate", "dp_shard", "zero")


def _chunk_costs(
    cfg: Config, cluster: Cluster, imbalance: float
) -> tuple[list[PassTimes], list[dict[str, PassTimes]]]:
    """Per global chunk: compute seconds, and the exposed communication by dim, per micro-batch; the
    same for every data-parallel split of a layout (the search tries several), so computed once."""
    p, t = cfg.parallel, cfg.training
    others = tuple(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in vars(p).items() if k not in _DP_KEYS
    )
    key = (
        model_key(cfg.model),
        others,
        t.micro_batch,
        t.seq_len,
        t.dtype,
        t.recompute,
        id(cluster),
        imbalance,
    )
    return _COSTS.get(key, lambda: _chunk_costs_of(cfg, cluster, imbalance), keep=cluster)


_COSTS: Memo[tuple[list[PassTimes], list[dict[str, PassTimes]]]] = Memo(limit=1024)


def _chunk_costs_of(
    cfg: Config, cluster: Cluster, imbalance: float
) -> tuple[list[PassTimes], list[dict[str, PassTimes]]]:
    p, m, t = cfg.parallel, cfg.model, cfg.training
    rates = cluster.rates(t.dtype)
    net = Network(cluster.gpu, cluster.links, cluster.overlap)
    split = layer_split(cfg)
    rows = t.micro_batch * t.seq_len // p.cp
    core = 4.0 * m.n_heads * m.head_size / p.tp * keys_per_query(t.seq_len, m.sliding_window) * rows
    attention_time = rates.attention_time(core)
    p2p = pp_p2p(cfg, net)
    compute, comm = [], []
    by_kind: dict[bool, dict[str, PassTimes]] = {}  # a layer's communication: dense or MoE
    for c, layers in enumerate(split):
        first, last = c == 0, c == len(split) - 1
        compute.append(chunk_times(cfg, layers, first, last, rates, imbalance))
        dims: dict[str, PassTimes] = {}
        parts = []
        for layer in layers:
            kind = m.is_moe_layer(layer)
            if kind not in by_kind:
                by_kind[kind] = layer_comm(cfg, layer, net, attention_time, imbalance)
                if "ep" in by_kind[kind] and net.overlap.ep:
                    experts = expert_times(cfg, layer, rates, imbalance)
                    rest = layer_times(cfg, layer, rates, imbalance) - experts
                    pieces = ep_pieces(cfg, layer, net, imbalance)
                    ep = overlapped_ep(pieces, rest, experts, cluster.links.overlap_sm_share)
                    by_kind[kind] = {**by_kind[kind], "ep": ep}
            parts.append(by_kind[kind])
        for part in [*parts, ends_comm(cfg, first, last, net)]:
            for dim, times in part.items():
                dims[dim] = dims.get(dim, PassTimes()) + times
        if p2p:
            dims["pp"] = PassTimes(f=p2p, b=p2p)
        comm.append(dims)
    return compute, comm


@lru_cache(maxsize=256)
def _schedule(pp: int, vpp: int, micro: int, schedule: str) -> CheckedSchedule:
    return checked_schedule(build_schedule(pp, vpp, micro, schedule))


@lru_cache(maxsize=4096)
def _pipeline(pp: int, vpp: int, micro: int, schedule: str, costs: tuple[tuple[float, float, float], ...]):
    """(makespan, per-rank peak in-flight) of the schedule on these per-chunk (F, B, W) costs."""
    split = schedule in SPLIT_BACKWARD
    chunk_costs = {}
    for c, (f, b, w) in enumerate(costs):
        chunk_costs[(Kind.F, c)] = f
        chunk_costs[(Kind.B, c)] = b if split else b + w
        chunk_costs[(Kind.W, c)] = w
    sim = simulate(_schedule(pp, vpp, micro, schedule), chunk_costs=chunk_costs)
    return sim.makespan, tuple(sim.peak_in_flight), sim.bubble_fraction


def _run_pipeline(cfg: Config, totals: list[PassTimes], micro: int, simulated: bool):
    """(makespan, per-rank peak in-flight chunk-micro-batches, bubble fraction) of the step's pipeline."""
    p = cfg.parallel
    if p.pp == 1:
        return micro * totals[0].total, (1,), 0.0
    if not simulated:
        return _screen_pipeline(cfg, totals, micro)
    scale = max(x.total for x in totals)
    # Costs relative to the largest chunk, each to 3 significant figures: the bubble's shape, shared by
    # many layouts. (To 1% of the largest chunk, a chunk 5 times smaller, as many are beside a head
    # chunk, was off by up to 2.6%, and the makespan came out shorter than the stage's own work.)
    rounded = tuple(tuple(float(f"{v / scale:.3g}") for v in (x.f, x.b, x.w)) for x in totals)
    makespan, in_flight, bubble = _pipeline(p.pp, p.vpp, micro, p.pp_schedule, rounded)
    return makespan * scale, in_flight, bubble


def _chunks(cfg: Config, pp_rank: int) -> list[int]:
    p = cfg.parallel
    return chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)


def _screen_pipeline(cfg: Config, totals: list[PassTimes], micro: int):
    """The published closed forms, for screening many layouts before the simulator times the best:
    bubble (pp−1)·(F+B+W) of a chunk over vpp for GPipe, 1F1B and interleaved (Narayanan et al. 2021),
    (pp−1)·(F+B−2W) for ZB-H1 (Qi et al. 2023); in flight pp−r (1F1B, ZB-H1), all m (GPipe), and
    Megatron's interleaved warm-up 2·(pp−r−1) + (vpp−1)·pp, plus one."""
    p = cfg.parallel
    ranks = [sum((totals[c] for c in _chunks(cfg, r)), PassTimes()) for r in range(p.pp)]
    stage = max(ranks, key=lambda x: x.total)
    chunk = max(totals, key=lambda x: x.total)
    if p.pp_schedule == "zero_bubble":
        bubble = (p.pp - 1) * max(0.0, chunk.f + chunk.b - chunk.w)
    elif p.pp_schedule in ("zbv", "dualpipev"):  # the forward ramp (docs/pipeline.md#v-shaped-schedules)
        bubble = (p.pp - 1) * max(chunk.f, chunk.f + chunk.b - chunk.w)
    else:
        bubble = (p.pp - 1) * chunk.total
    makespan = micro * stage.total + bubble
    if p.pp_schedule == "gpipe":
        in_flight = [micro] * p.pp
    elif p.pp_schedule in ("zbv", "dualpipev"):  # chunk activations: 2·pp, DualPipe's one more
        in_flight = [min(2 * micro, 2 * p.pp + (p.pp_schedule == "dualpipev"))] * p.pp
    elif p.pp_schedule == "interleaved":
        in_flight = [min(micro * p.vpp, 2 * (p.pp - r - 1) + (p.vpp - 1) * p.pp + 1) for r in range(p.pp)]
    else:
        in_flight = [min(micro, p.pp - r) for r in range(p.pp)]
    return makespan, tuple(in_flight), bubble / makespan


def _shared_cores(cfg: Config, totals: list[PassTimes], micro: int, makespan: float, speedup: float) -> float:
    """The pipeline's makespan when its ranks share cores (speedup > 1): a stage idle in the bubble, or
    lighter than the others, leaves its core to the busy ones. Two bounds of a work-conserving machine
    (Graham 1969): all the stages' work spread evenly over the ranks (their mean busy time, at the
    all-busy rate), and the schedule's critical path at a lone rank's speed; the larger holds."""
    p = cfg.parallel
    if speedup <= 1.0 or p.pp == 1:
        return makespan
    busy = [micro * sum(totals[c].total for c in _chunks(cfg, r)) for r in range(p.pp)]
    return max(sum(busy) / p.pp, makespan / speedup)


def least_memory(cfg: Config, cluster: Cluster) -> float:
    """Bytes per GPU of the most loaded stage with one micro-batch in flight: a lower bound of
    `estimate(...).memory_bytes_per_gpu`, cheap enough to drop layouts before timing them."""
    stages = {stage_signature(cfg, r): r for r in range(cfg.parallel.pp)}  # one of each kind of stage
    return max(sum(stage_memory(cfg, cluster.gpus, r, 1, cluster.memory).values()) for r in stages.values())


def on_nodes(cfg: Config, cluster: Cluster) -> Config:
    """`cfg` with run.gpus_per_node the cluster's where the run does not set it: the nodes the
    hierarchical dispatch's two hops (their time and what op recompute keeps of them) are cut by."""
    if cfg.run.gpus_per_node:
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, gpus_per_node=cluster.gpu.gpus_per_node))


def stage_memories(cfg: Config, cluster: Cluster, simulated: bool = True) -> list[dict[str, float]]:
    """Each pipeline stage's rank 0 at its peak, bytes by part (gpu_memory.py), with the activations its
    schedule holds at most, or (`simulated=False`) the screen's closed-form count of micro-batches in
    flight (what `estimate` reports the most loaded of)."""
    cfg = on_nodes(cfg, cluster)
    p, t = cfg.parallel, cfg.training
    if simulated:  # the schedule's own walk: no timing needed
        return [stage_memory(cfg, cluster.gpus, r, None, cluster.memory) for r in range(p.pp)]
    micro = micro_batches_per_step(t.global_batch, t.micro_batch, p.dp_replicate * p.dp_shard)
    compute, comm = _chunk_costs(cfg, cluster, 1.0)
    totals = [c + sum(d.values(), PassTimes()) for c, d in zip(compute, comm, strict=True)]
    _, in_flight, _ = _run_pipeline(cfg, totals, micro, simulated)
    return [stage_memory(cfg, cluster.gpus, r, in_flight[r], cluster.memory) for r in range(p.pp)]


def _model_flops_per_token(cfg: Config) -> float:
    """training_flops_per_token, once per model and sequence length (the MFU's numerator)."""
    key = (model_key(cfg.model), cfg.training.seq_len)
    return _FLOPS.get(key, lambda: training_flops_per_token(cfg.model, cfg.training.seq_len))


_FLOPS: Memo[float] = Memo(limit=256)


def _stage_step(
    cfg: Config,
    cluster: Cluster,
    r: int,
    micro: int,
    costs: tuple[list[PassTimes], list[dict[str, PassTimes]], list[PassTimes]],
) -> tuple[StageBase, dict[str, float], float, float]:
    """Stage r's memory whatever its micro-batches in flight, its step by part (compute and
    communication of its micro-batches, then its data-parallel tail and optimizer), its busy time and
    its tail. `costs`: per chunk and micro-batch, compute, communication by dim, and their total."""
    t = cfg.training
    compute, comm, totals = costs
    net, rates = Network(cluster.gpu, cluster.links, cluster.overlap), cluster.rates(t.dtype)
    chunks, split = _chunks(cfg, r), layer_split(cfg)
    mb = sum((totals[c] for c in chunks), PassTimes())
    base = stage_base(cfg, cluster.gpus, r, cluster.memory)
    tail = dp_comm(cfg, r, net, micro, mb, sum(len(split[c]) for c in chunks))
    tail["optimizer"] = (
        OPTIMIZER_BYTES_PER_ELEMENT * base.state["optimizer"] / 8 / (rates.hbm * rates.eff.hbm)
    )
    if t.optimizer == "muon":  # each matrix orthogonalized once, by its owner (plan/muon.py)
        tail["muon"] = muon_step_time(cfg, r, cluster.gpu, cluster.links, rates.eff.matmul)
    parts = {"compute": micro * sum(compute[c].total for c in chunks)}
    for c in chunks:
        for dim, times in comm[c].items():
            parts[dim] = parts.get(dim, 0.0) + micro * times.total
    busy = sum(parts.values())
    parts.update(tail)
    return base, parts, busy, sum(tail.values())


def exchange_choices(cfg: Config) -> tuple[str, ...]:
    """The cp exchanges `cfg` can run: MLA's latents too under a ring or all-gather context parallel."""
    p = cfg.parallel
    return (
        ("kv", "latent") if cfg.model.is_mla and p.cp > 1 and p.cp_impl in ("ring", "allgather") else ("kv",)
    )


def with_exchange(cfg: Config, exchange: str) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp_exchange=exchange))


def resolved_exchange(cfg: Config, cluster: Cluster, imbalance: float = 1.0) -> Config:
    """`cfg` with parallel.cp_exchange = "auto" made the planner's choice: the exchange whose step it
    predicts the shorter (the volume the latents save against their up-projection per arriving block)."""
    if cfg.parallel.cp_exchange != "auto":
        return cfg
    choices = exchange_choices(cfg)
    if len(choices) == 1:
        return with_exchange(cfg, choices[0])
    times = {x: estimate(with_exchange(cfg, x), cluster, imbalance=imbalance).step_time_s for x in choices}
    return with_exchange(cfg, min(times, key=times.__getitem__))


def estimate(cfg: Config, cluster: Cluster, simulated: bool = True, imbalance: float = 1.0) -> Estimate:
    """Predict one step of `cfg` (its layout already in cfg.parallel, dp_shard resolved) on `cluster`;
    `simulated=False` takes the pipeline's closed forms instead of the simulator (the search's screen);
    `imbalance`: an MoE model's routing, the busiest expert rank's tokens over the mean (1: balanced).
    A cp_exchange of "auto" is priced as what it resolves to (`resolved_exchange`)."""
    if imbalance < 1.0:
        raise ValueError(
            f"routing imbalance is max / mean tokens per expert rank, at least 1; got {imbalance}"
        )
    if cfg.parallel.cp_exchange == "auto":
        cfg = resolved_exchange(cfg, cluster, imbalance)
    cfg = on_nodes(cfg, cluster)
    p, t = cfg.parallel, cfg.training
    world = cluster.gpus
    micro = micro_batches_per_step(t.global_batch, t.micro_batch, p.dp_replicate * p.dp_shard)
    compute, comm = _chunk_costs(cfg, cluster, imbalance)
    totals = [c + sum(d.values(), PassTimes()) for c, d in zip(compute, comm, strict=True)]
    makespan, in_flight, bubble = _run_pipeline(cfg, totals, micro, simulated)
    makespan = _shared_cores(cfg, totals, micro, makespan, cluster.alone_speedup)
    worst: tuple[float, dict[str, float]] = (-1.0, {})
    tails: list[float] = []
    memory: dict[str, float] = {}
    done: dict[tuple, tuple[StageBase, dict[str, float], float, float]] = {}
    for r in range(p.pp):
        # Stages alike (stage_signature) cost the same but for their micro-batches in flight.
        key = stage_signature(cfg, r)
        if key not in done:
            done[key] = _stage_step(cfg, cluster, r, micro, (compute, comm, totals))
        base, parts, busy, tail = done[key]
        if simulated and p.pp > 1:  # the schedule's walk: each rank's own
            activations = schedule_activation_bytes(cfg, r, layer_split(cfg))
        else:
            activations = (1 if simulated else in_flight[r]) * base.largest
        stage = stage_total(base, activations, cluster.memory)
        if sum(stage.values()) > sum(memory.values()):
            memory = stage
        tails.append(tail)
        if busy + tails[-1] > worst[0]:  # the stage whose own work is the most: the breakdown shown
            worst = (busy + tails[-1], dict(parts))
    step = makespan + max(tails)
    if cluster.alone_speedup <= 1.0:  # no stage finishes before its own work (3-figure rounding aside)
        step = max(step, sum(worst[1].values()))
    idle = step - sum(worst[1].values())  # the bubble it sees, or (shared cores) the time others lend it
    worst[1]["lent_cores" if idle < -1e-9 * step else "pp_bubble"] = idle
    tokens = t.global_batch * t.seq_len
    flops = _model_flops_per_token(cfg) * tokens
    return Estimate(
        step_time_s=step,
        tokens_per_sec_per_gpu=tokens / step / world,
        mfu=flops / (step * world * cluster.peak),
        memory_bytes_per_gpu=sum(memory.values()),
        memory=memory,
        time=worst[1],
        bubble_fraction=bubble,
        pipeline_s=makespan,
        memory_limit_bytes=cluster.gpu.memory_bytes,
    )
