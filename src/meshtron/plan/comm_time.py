"""Seconds of each dim's communication per step, and how much of it compute hides.

Volumes are those plan/comm.py counts (and tests check against comm.py's counters), in the compute
dtype for activations and in the reduce dtype for gradients; times come from plan/network.py.

  dim   what, per micro-batch unless said                             hidden behind compute?
  tp    4 all-reduces of [tokens, dim] per layer; sp turns each     no (meshtron runs them inline);
        into an all-gather + a reduce-scatter of the same size and     `Overlap.tp` for frameworks that
        gathers each region's input again in backward (5); a           overlap them with the GEMMs
        recomputed block's rerun reduces the attention's output
        again (plan/comm.py tp_rerun_units); one more after the
        embedding (forward), one before the head (backward), and
        the vocab-parallel loss's 3 all-reduces of one number per token
  cp    ring: cp−1 K/V block exchanges per layer forward; backward     ring: yes, behind each step's
        the K/V again (cp−1) and the fp32 dK/dV accumulators' cp       attention; alltoall and
        hops; alltoall: q, k, v and the output (and their gradients)   allgather: no
        once each; allgather: K/V gathered, their gradients
        reduce-scattered
  ep    per MoE layer, the count table's all-gather and 4 all-to-alls  no (meshtron); `Overlap.ep`: each
        of top_k·tokens·dim (dispatch and combine, forward and         piece beside the other micro-
        backward) and 2 of their gate values; the busiest rank         batch's compute it pairs with,
        receives `imbalance` times the mean (1: balanced routing);     which it slows (overlapped_ep)
        a capacity's slots, the all-gather dispatch, dedup and
        hierarchical as plan/comm.py counts them; full recompute
        dispatches again in backward (op keeps what arrived, unless
        op_recompute_dispatch = "rerun")
  pp    one activation forward and one gradient backward per chunk     yes (non-blocking sends)
        boundary
  dp    per step: DDP all-reduces the gradients; ZeRO-1/2 reduce-     the reduction: behind the last
        scatter them (ZeRO-2 every micro-batch) and all-gather the     micro-batch's backward, bar the
        updated parameters; ZeRO-3 all-gathers every layer forward     last bucket; ZeRO-1/2's gather:
        and backward and reduce-scatters backward; replicas            behind the next forward (unit by
        all-reduce the shard. ZeRO-3 pays the latency once per         unit, `Overlap.dp_gather`);
        unit (each layer, and the root of embedding and head on the    ZeRO-3: prefetched behind each
        end stages), and so do ZeRO-1/2's post-step gathers; DDP's     layer's compute
        and ZeRO-1/2's reduction buckets go back to back and pay it
        once. Every step also all-reduces the loss and the clipping
        norm's sums (over dp·cp, and pp)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshtron.config.row_blocks import padded_numel
from meshtron.config.schema import Config
from meshtron.plan.comm import capacity_slots, cp_token_bytes, reruns_dispatch, tp_rerun_units
from meshtron.plan.compute_time import PassTimes
from meshtron.plan.hardware import Accelerator
from meshtron.plan.network import Collective, Group, LinkEfficiency, collective_time, ep_group, mesh_strides
from meshtron.plan.routing import hierarchical_rows, ranks_per_token
from meshtron.plan.state import rank_parameters, stage_key
from meshtron.utils.memo import Memo


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """Which communication runs behind compute (meshtron's behaviour by default)."""

    dp_reduce: bool = True
    dp_gather: bool = True
    fsdp_prefetch: bool = True
    tp: bool = False
    cp_ring: bool = True
    ep: bool = False
    ep_hops: bool = False
    pp_p2p: bool = True

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """`meshtron plan --overlap`: the names of what is hidden (OVERLAP_NAMES), comma-separated, or
        "none"; everything not named is exposed. Raises ValueError naming the unknown names."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        if names == ["none"]:
            return cls(**{field: False for field in OVERLAP_NAMES.values()})
        unknown = [n for n in names if n not in OVERLAP_NAMES]
        if unknown or not names:
            raise ValueError(
                f"--overlap={text}: {', '.join(unknown) or 'nothing'} is not one of "
                f"{', '.join(OVERLAP_NAMES)} (or none)"
            )
        return cls(**{field: name in names for name, field in OVERLAP_NAMES.items()})

    def names(self) -> list[str]:
        """What is hidden, in `--overlap`'s names."""
        return [name for name, field in OVERLAP_NAMES.items() if getattr(self, field)]


# `--overlap` names -> Overlap fields: the data-parallel gradient reduction behind backward, ZeRO-1/2's
# parameter gather behind the next forward, ZeRO-3's gathers prefetched behind each layer, tp's
# collectives behind the GEMMs, the ring's K/V hops behind attention, the expert all-to-alls behind the
# other micro-batch's compute, the hierarchical dispatch's two hops behind each other, and the pipeline's
# sends.
OVERLAP_NAMES = {
    "dp_reduce": "dp_reduce",
    "dp_gather": "dp_gather",
    "fsdp_prefetch": "fsdp_prefetch",
    "tp": "tp",
    "cp": "cp_ring",
    "ep": "ep",
    "ep_hops": "ep_hops",
    "pp": "pp_p2p",
}


@dataclass(frozen=True)
class Network:
    """The cluster's links as the step sees them."""

    gpu: Accelerator
    eff: LinkEfficiency
    overlap: Overlap


def groups(cfg: Config) -> dict[str, Group]:
    """Every dim's group on this cluster's nodes (mesh order of comm/mesh.py)."""
    p = cfg.parallel
    dense = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    strides = mesh_strides(dense, ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    out = {name: Group(size, strides[name], 0) for name, size in dense.items()}
    out["shard"] = Group(p.dp_shard * p.cp, p.tp, 0)  # dp_shard x cp, flattened
    out["ep"] = ep_group(p.ep, p.tp, p.expert_tp, 0)
    etp = out["ep"].stride
    out["edp"] = Group(p.dp_shard * p.cp * p.tp // (p.ep * etp), p.ep * etp, 0)
    return out


def _on(net: Network, group: Group) -> Group:
    return Group(group.size, group.stride, net.gpu.gpus_per_node)


def layer_comm(
    cfg: Config, layer: int, net: Network, attention_time: float, imbalance: float = 1.0
) -> dict[str, PassTimes]:
    """Exposed F and B seconds of one layer's tp, cp and ep communication for one micro-batch."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    g = groups(cfg)
    act = 2 if t.dtype != "fp32" else 4
    tokens = t.micro_batch * t.seq_len // p.cp
    out: dict[str, PassTimes] = {}
    if p.tp > 1:
        one = collective_time("all_reduce", tokens * m.dim * act, _on(net, g["tp"]), net.gpu, net.eff)
        # sp gathers each region's input again in backward (two all-gathers: one all-reduce's time),
        # or a recomputed block's rerun does, which may reduce the attention's output again.
        extra = (1 if p.sp else 0) + tp_rerun_units(t.recompute, p.sp)
        out["tp"] = PassTimes(f=2 * one, b=(2 + extra) * one) * (0.0 if net.overlap.tp else 1.0)
    if p.cp > 1:
        out["cp"] = _cp_comm(cfg, _on(net, g["cp"]), net, attention_time, act)
    if p.ep > 1 and m.is_moe_layer(layer):
        out["ep"] = ep_pieces(cfg, layer, net, imbalance).passes
    return out


@dataclass(frozen=True)
class EpPieces:
    """Seconds of one MoE layer's four exchanges for one micro-batch: the forward's dispatch and combine,
    and the backward's combine gradient (sent back to the experts) and dispatch gradient; and, where
    the block is recomputed, its rerun of the forward's dispatch."""

    dispatch_f: float = 0.0
    combine_f: float = 0.0
    combine_b: float = 0.0
    dispatch_b: float = 0.0
    rerun_b: float = 0.0  # the forward's dispatch again, where recompute reruns it (plan/comm.py)

    @property
    def passes(self) -> PassTimes:
        return PassTimes(
            f=self.dispatch_f + self.combine_f, b=self.combine_b + self.dispatch_b + self.rerun_b
        )

    @property
    def total(self) -> float:
        return self.passes.total


def ep_pieces(cfg: Config, layer: int, net: Network, imbalance: float = 1.0) -> EpPieces:
    """An MoE layer's expert exchanges (ep > 1), piece by piece, before any overlap with compute: the
    exchanges of plan/comm.py's `_ep_bytes`, timed."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    act = 2 if t.dtype != "fp32" else 4
    ep = _on(net, groups(cfg)["ep"])
    tokens = t.micro_batch * t.seq_len // p.cp
    sent = tokens // (1 if p.expert_tp else p.tp)  # etp = 1: each tp rank sends 1/tp of the tokens
    if p.ep_dispatch == "dedup":
        rows = imbalance * sent * ranks_per_token(m, p.ep)
        pieces = _once_per_rank(ep, net, rows, m.n_experts // p.ep, m.dim * act)
    elif p.ep_dispatch == "hierarchical":
        pieces = _hierarchical_comm(cfg, ep, net, imbalance * sent, act)
    elif p.ep_dispatch == "allgather":  # routing-free: every rank gathers every token (no imbalance)
        pieces = _gathered(cfg, ep, net, sent, act)
    else:
        pieces = _all_to_all(cfg, ep, net, imbalance * m.top_k * sent, act)
    if reruns_dispatch(t):  # the rerun block dispatches again, and stops before the combine
        pieces = dataclasses.replace(pieces, rerun_b=pieces.dispatch_f)
    return pieces


def _all_to_all(cfg: Config, ep: Group, net: Network, rows: float, act: int) -> EpPieces:
    """The all-to-all dispatch of `rows` rows each way, with their gates (in the rows' dtype) and the
    count table; with a capacity, every expert's slots (even, so no table)."""
    m, t = cfg.model, cfg.training
    counts = collective_time("all_gather", 8 * ep.size * m.n_experts, ep, net.gpu, net.eff)
    if m.capacity_factor > 0:
        tokens = t.micro_batch * t.seq_len // cfg.parallel.cp
        rows, counts = capacity_slots(m, tokens), 0.0
    one = collective_time("all_to_all", rows * m.dim * act, ep, net.gpu, net.eff)
    gates = collective_time("all_to_all", rows * act, ep, net.gpu, net.eff)
    return EpPieces(dispatch_f=counts + one + gates, combine_f=one, combine_b=one, dispatch_b=one + gates)


def _gathered(cfg: Config, ep: Group, net: Network, tokens: float, act: int) -> EpPieces:
    """The all-gather dispatch of `tokens` tokens per rank: tokens, gates, expert ids (int64) and keep
    mask (uint8) gathered (4 calls), the fp32 sums reduce-scattered back; backward the gradients of the
    tokens and gates reduce-scattered (2 calls) and the sums' gradient gathered."""
    m = cfg.model

    def full(kind: Collective, row_bytes: float, calls: int = 1) -> float:
        return collective_time(kind, ep.size * tokens * row_bytes, ep, net.gpu, net.eff, calls=calls)

    return EpPieces(
        dispatch_f=full("all_gather", m.dim * act + m.top_k * (act + 8 + 1), calls=4),
        combine_f=full("reduce_scatter", m.dim * 4),
        combine_b=full("all_gather", m.dim * 4),
        dispatch_b=full("reduce_scatter", m.dim * act + m.top_k * act, calls=2),
    )


def overlapped_ep(ep: EpPieces, attention: PassTimes, experts: PassTimes, sm_share: float) -> PassTimes:
    """What an MoE layer's exchanges (`ep`) still cost when one micro-batch's forward of the layer runs
    beside another's backward of it, as Megatron-Core's combined 1F1B and DualPipe pair them: two
    streams in four phases (`attention`: the layer but its experts; `experts`: compute_time.expert_times)

      phase           1           2             3            4
      communication   combine_b   dispatch_f    dispatch_b   combine_f
      compute         attn W+F    experts B+W   experts F    attn B

    where each phase's pieces need the phase before (the dispatch its attention, the experts' backward
    its combine gradient, the experts' forward its dispatch, ...), so a phase takes its longer piece
    and what exceeds the compute is exposed. The communication kernels slow the compute they run beside
    by `sm_share` of the time they hide. Split over F and B as the exchanges were."""
    total = ep.total
    if total <= 0.0:
        return ep.passes
    phases = [
        (ep.combine_b, attention.f + attention.w),
        (ep.dispatch_f, experts.b + experts.w),
        (ep.dispatch_b, experts.f),
        (ep.combine_f, attention.b),
    ]
    # A recomputed block's rerun dispatch has no partner of its own: exposed.
    exposed = sum(max(comm - compute, 0.0) for comm, compute in phases) + ep.rerun_b
    return ep.passes * ((exposed + sm_share * (total - exposed)) / total)


def _once_per_rank(group: Group, net: Network, rows: float, width: int, row_bytes: int) -> EpPieces:
    """The dedup exchange (parallel/expert.py send_once_per_rank) of `rows` rows each way over `group`,
    `width` experts per member: forward the row counts, then tokens, gates and chosen-masks, then the
    partial sums back (4 calls); backward the partial sums' gradient, then the tokens' and the gates'
    (3 calls)."""

    def exchange(nbytes: float, calls: int) -> float:
        return collective_time("all_to_all", rows * nbytes, group, net.gpu, net.eff, calls=calls)

    counts = collective_time("all_gather", 8 * group.size, group, net.gpu, net.eff)
    back = exchange(row_bytes, 1)
    return EpPieces(
        dispatch_f=counts + exchange(row_bytes + 5 * width, 3),
        combine_f=back,
        combine_b=back,
        dispatch_b=exchange(row_bytes + 4 * width, 2),
    )


def _hierarchical_comm(cfg: Config, ep: Group, net: Network, tokens: float, act: int) -> EpPieces:
    """The two hops (plan/routing.py hierarchical_rows): the dedup exchange over the nodes, one rank per
    node (the network), then inside each node (NVLink); one node: the inside hop alone. meshtron runs the
    hops one after the other; DeepEP's internode kernels forward each chunk over NVLink while the next
    arrives over the network (`Overlap.ep_hops`), so the slower hop sets the time."""
    node = cfg.run.gpus_per_node or net.gpu.gpus_per_node  # the run's nodes, where it says
    per_node = Group(ep.size, ep.stride, node).per_node
    hops = {"ep_inter": Group(ep.size // per_node, node, node), "ep_intra": Group(per_node, ep.stride, node)}
    times = [
        _once_per_rank(hops[name], net, rows, width, cfg.model.dim * act)
        for name, rows, width, _ in hierarchical_rows(cfg.model, ep.size, per_node, tokens)
    ]
    how = max if net.overlap.ep_hops else sum  # forwarded as it arrives: the slower hop, piece by piece
    return EpPieces(*(how(getattr(x, k) for x in times) for k in vars(times[0])))


def ends_comm(cfg: Config, first: bool, last: bool, net: Network) -> dict[str, PassTimes]:
    """Tensor parallel around the embedding (forward) and the head (backward), and the vocab-parallel
    loss's three per-token all-reduces, on the chunks that hold them, for one micro-batch."""
    p, t = cfg.parallel, cfg.training
    if p.tp == 1 or not (first or last) or net.overlap.tp:
        return {}
    tp = _on(net, groups(cfg)["tp"])
    tokens = t.micro_batch * t.seq_len // p.cp
    act = collective_time(
        "all_reduce", tokens * cfg.model.dim * (2 if t.dtype != "fp32" else 4), tp, net.gpu, net.eff
    )
    loss = collective_time("all_reduce", 3 * tokens * 4, tp, net.gpu, net.eff, calls=3)
    regather = 0.5 if p.sp else 0.0  # sp: the head's input gathered again in backward
    return {"tp": PassTimes(f=act * first + loss * last, b=act * (1 + regather) * last)}


def _cp_comm(cfg: Config, group: Group, net: Network, attention_time: float, act: int) -> PassTimes:
    """Context parallel of one layer: the exchanges of plan/comm.py's `_cp_bytes`, timed (a recomputed
    attention's rerun sends its forward exchange again in backward)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    cp, tokens, rerun = p.cp, t.micro_batch * t.seq_len // p.cp, t.recompute != "none"
    kv = cp_token_bytes(cfg, act)  # keys and values, or MLA's latents
    if p.cp_impl in ("ring", "hybrid"):
        hop = collective_time("p2p", tokens * kv, group, net.gpu, net.eff)
        accumulator = collective_time("p2p", tokens * kv * 4 / act, group, net.gpu, net.eff)
        forward, backward = (cp - 1) * hop, (cp - 1) * hop + cp * accumulator
        if net.overlap.cp_ring:  # each step's exchange runs behind the previous step's attention
            f = max(0.0, forward - attention_time)
            return PassTimes(f=f, b=max(0.0, backward - 2 * attention_time) + rerun * f)
        return PassTimes(f=forward, b=backward + rerun * forward)
    if p.cp_impl == "allgather":
        gather = collective_time("all_gather", cp * tokens * kv, group, net.gpu, net.eff)
        return PassTimes(f=gather, b=(2 + rerun) * gather)
    heads = m.n_heads // p.tp
    q, o, kv_rep = (
        heads * m.head_size * act,
        heads * m.value_size * act,
        max(kv, (m.head_size + m.value_size) * act * cp),
    )
    exchange = collective_time("all_to_all", tokens * (q + o + kv_rep), group, net.gpu, net.eff)
    again = q + kv_rep + (o if t.recompute != "selective" else 0)
    rerun_time = collective_time("all_to_all", tokens * again, group, net.gpu, net.eff) if rerun else 0.0
    return PassTimes(f=exchange, b=exchange + rerun_time)


def pp_p2p(cfg: Config, net: Network) -> float:
    """Seconds of one boundary message (activation or gradient) when it is not hidden."""
    p, t = cfg.parallel, cfg.training
    if p.pp == 1 or net.overlap.pp_p2p:
        return 0.0
    act = 2 if t.dtype != "fp32" else 4
    shards = p.tp if p.sp else 1
    message = t.micro_batch * t.seq_len // p.cp // shards * cfg.model.dim * act
    return collective_time("p2p", message, _on(net, groups(cfg)["pp"]), net.gpu, net.eff)


def _engine_time(
    sizes: tuple[int, int], shard: Group, replicas: Group, cfg: Config, net: Network, units: int
):
    """(per micro-batch forward, per micro-batch backward, after the last backward, after the step)
    seconds of one data-parallel engine's collectives, before any overlap; `sizes`: its elements, and
    padded to the shard group (_engine_sizes); `units`: the gather units (each layer, and the root),
    which ZeRO-3 and ZeRO-1/2's post-step gathers pay the latency of."""
    p, t = cfg.parallel, cfg.training
    reduce = 2 if p.reduce_dtype == "bf16" else 4
    full, padded = sizes
    # ZeRO-3 waits for each unit's gather in turn; DDP's and ZeRO-1/2's buckets pipeline back to back,
    # their latencies behind each other's transfers (NCCL's channels), so they count once.
    calls = units if p.zero == 3 else 1

    def timed(kind: Collective, nbytes: float, group: Group) -> float:
        return collective_time(kind, nbytes, group, net.gpu, net.eff, calls)

    h = cfg.fault_tolerance.diloco_every  # DiLoCo: fp32 weights across replicas every h steps instead
    across, every = (4, h) if h else (reduce, 1)
    if shard.size == 1:
        return 0.0, 0.0, timed("all_reduce", across * full, replicas) / every, 0.0
    replica = timed("all_reduce", across * padded / shard.size, replicas) / every
    scatter = timed("reduce_scatter", reduce * padded, shard)
    if p.zero == 3:
        gather = timed("all_gather", (2 if t.dtype != "fp32" else 4) * padded, shard)
        backward = gather * (1 if p.reshard_after_forward else 0) + scatter
        return gather, backward, replica, 0.0
    gather = collective_time("all_gather", 4 * padded, shard, net.gpu, net.eff, units)
    return 0.0, (scatter if p.zero == 2 else 0.0), (0.0 if p.zero == 2 else scatter) + replica, gather


def _step_sync(cfg: Config, net: Network, g: dict[str, Group]) -> float:
    """The step's small all-reduces: the loss and clipping's norm over dp·cp, and over pp."""
    p = cfg.parallel
    world = Group(p.dp_replicate * p.dp_shard * p.cp, p.tp, net.gpu.gpus_per_node)
    sync = collective_time("all_reduce", 8, world, net.gpu, net.eff, calls=2)
    return sync + collective_time("all_reduce", 8, g["pp"], net.gpu, net.eff, calls=2)


def _engine_sizes(cfg: Config, pp_rank: int, shard: int, edp: int) -> tuple[list[tuple[int, int]], int]:
    """(elements, elements padded to its group) of each data-parallel engine of stage `pp_rank` (the
    dense parameters over `shard`; under ep the experts over `edp`), and its MoE layers; cached per
    stage, as the search asks for every micro-batch size and recompute mode of it."""
    p = cfg.parallel

    def sizes_of() -> tuple[list[tuple[int, int]], int]:
        params = rank_parameters(cfg, pp_rank)
        groups = [([x.shape for x in params if not x.expert or not p.experts_apart], shard)]
        if p.experts_apart:
            groups.append(([x.shape for x in params if x.expert], edp))
        sizes = [
            (
                sum(math.prod(s) for s in shapes),
                sum(padded_numel(s, n, cfg.training.optimizer != "muon") for s in shapes),
            )
            for shapes, n in groups
        ]
        return sizes, sum(1 for x in params if x.expert and x.name.endswith("w1"))

    return _SIZES.get((stage_key(cfg, pp_rank), shard, edp, p.experts_apart), sizes_of)


_SIZES: Memo[tuple[list[tuple[int, int]], int]] = Memo()


def dp_comm(
    cfg: Config, pp_rank: int, net: Network, micro: int, mb: PassTimes, layers: int
) -> dict[str, float]:
    """Exposed data-parallel seconds per step on stage `pp_rank`; `mb` is one micro-batch's compute on
    the rank and `layers` its layer count (ZeRO-3's first layer's gather cannot be prefetched)."""
    p, o = cfg.parallel, net.overlap
    g = {name: _on(net, group) for name, group in groups(cfg).items()}
    engines, moe_layers = _engine_sizes(cfg, pp_rank, g["shard"].size, g["edp"].size)
    exposed = _step_sync(cfg, net, g)
    bucket = p.bucket_mb * 2**20
    root = pp_rank in (0, p.pp - 1)  # the embedding's and the head's unit
    for index, (sizes, shard) in enumerate(zip(engines, (g["shard"], g["edp"]), strict=False)):
        units = layers + root if index == 0 else max(1, moe_layers)
        forward, backward, last, after = _engine_time(sizes, shard, g["dp_replicate"], cfg, net, units)
        if p.zero == 3 and shard.size > 1 and o.fsdp_prefetch:
            first = (forward + backward) / max(layers, 1)
            exposed += micro * (max(0.0, forward - mb.f) + max(0.0, backward - mb.b - mb.w)) + first
        else:
            exposed += micro * (forward + backward)
        nbytes = 4 * sizes[0]
        tail = last * min(1.0, bucket / nbytes) if nbytes else 0.0  # the last bucket waits for backward
        exposed += max(tail, last - mb.b - mb.w) if o.dp_reduce else last
        exposed += max(0.0, after - mb.f) if o.dp_gather else after
    return {"dp": exposed}
