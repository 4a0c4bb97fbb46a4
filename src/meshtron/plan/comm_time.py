"""Seconds of each dim's communication per step, and how much of it compute hides.

Volumes are those plan/comm.py counts (and tests check against comm.py's counters), in the compute
dtype for activations and in the reduce dtype for gradients; times come from plan/network.py.

  dim   what, per micro-batch unless said                             hidden behind compute?
  tp    4 all-reduces of [tokens, dim] per layer (6 with full         no (meshtron runs them inline);
        recompute); sp turns each into an all-gather + a reduce-       `Overlap.tp` for frameworks that
        scatter of the same size                                       overlap them with the GEMMs
  cp    ring: cp−1 K/V block exchanges per layer forward, and the      ring: yes, behind each step's
        K/V plus their gradients backward; alltoall: q, k, v and the   attention; alltoall and
        output (and their gradients) once each; allgather: K/V         allgather: no
        gathered, their gradients reduce-scattered
  ep    4 all-to-alls of top_k·tokens·dim per MoE layer (dispatch and  no (meshtron), `Overlap.ep` for
        combine, forward and backward)                                 DualPipe-style overlap
  pp    one activation forward and one gradient backward per chunk     yes (non-blocking sends)
        boundary
  dp    per step: DDP all-reduces the gradients; ZeRO-1/2 reduce-     the reduction: behind the last
        scatter them (ZeRO-2 every micro-batch) and all-gather the     micro-batch's backward, bar the
        updated parameters; ZeRO-3 all-gathers every layer forward     last bucket; ZeRO-1/2's gather:
        and backward and reduce-scatters backward; replicas            no (meshtron, `Overlap.dp_gather`
        all-reduce the shard                                           otherwise); ZeRO-3: prefetched
                                                                       behind each layer's compute
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.config import Config
from meshtron.plan.compute_time import PassTimes
from meshtron.plan.hardware import Accelerator
from meshtron.plan.network import Group, LinkEfficiency, collective_time, mesh_strides
from meshtron.plan.state import rank_parameters


@dataclass(frozen=True)
class Overlap:
    """Which communication runs behind compute (meshtron's behaviour by default)."""

    dp_reduce: bool = True
    dp_gather: bool = False
    fsdp_prefetch: bool = True
    tp: bool = False
    cp_ring: bool = True
    ep: bool = False
    pp_p2p: bool = True


@dataclass(frozen=True)
class Network:
    """The cluster's links as the step sees them."""

    gpu: Accelerator
    eff: LinkEfficiency
    overlap: Overlap


def groups(cfg: Config) -> dict[str, Group]:
    """Every dim's group on this cluster's nodes (mesh order of mesh.py)."""
    p = cfg.parallel
    dense = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    strides = mesh_strides(dense, ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    out = {name: Group(size, strides[name], 0) for name, size in dense.items()}
    out["shard"] = Group(p.dp_shard * p.cp, p.tp, 0)  # dp_shard x cp, flattened
    out["ep"] = Group(p.ep, p.tp, 0)
    out["edp"] = Group(p.dp_shard * p.cp // p.ep, p.ep * p.tp, 0)
    return out


def _on(net: Network, group: Group) -> Group:
    return Group(group.size, group.stride, net.gpu.gpus_per_node)


def layer_comm(cfg: Config, layer: int, net: Network, attention_time: float) -> dict[str, PassTimes]:
    """Exposed F and B seconds of one layer's tp, cp and ep communication for one micro-batch."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    g = groups(cfg)
    act = 2 if t.dtype == "bf16" else 4
    tokens = t.micro_batch * t.seq_len // p.cp
    out: dict[str, PassTimes] = {}
    if p.tp > 1:
        one = collective_time("all_reduce", tokens * m.dim * act, _on(net, g["tp"]), net.gpu, net.eff)
        extra = 2 if t.recompute == "full" else 0
        out["tp"] = PassTimes(f=2 * one, b=(2 + extra) * one) * (0.0 if net.overlap.tp else 1.0)
    if p.cp > 1:
        out["cp"] = _cp_comm(cfg, _on(net, g["cp"]), net, attention_time, act)
    if p.ep > 1 and m.is_moe_layer(layer):
        one = collective_time(
            "all_to_all", m.top_k * tokens * m.dim * act, _on(net, g["ep"]), net.gpu, net.eff
        )
        out["ep"] = PassTimes(f=2 * one, b=2 * one) * (0.0 if net.overlap.ep else 1.0)
    return out


def _cp_comm(cfg: Config, group: Group, net: Network, attention_time: float, act: int) -> PassTimes:
    """Context parallel of one layer: the exchanges of plan/comm.py's `_cp_bytes`, timed."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    cp, tokens = p.cp, t.micro_batch * t.seq_len // p.cp
    kv = m.kv_heads_per_rank(p.tp) * m.head_size * act
    q = m.n_heads // p.tp * m.head_size * act
    if p.cp_impl in ("ring", "hybrid"):
        hop = collective_time("p2p", 2 * tokens * kv, group, net.gpu, net.eff)
        forward, backward = (cp - 1) * hop, 2 * (cp - 1) * hop
        if net.overlap.cp_ring:  # each step's exchange runs behind the previous step's attention
            return PassTimes(f=max(0.0, forward - attention_time), b=max(0.0, backward - 2 * attention_time))
        return PassTimes(f=forward, b=backward)
    if p.cp_impl == "allgather":
        gather = collective_time("all_gather", 2 * cp * tokens * kv, group, net.gpu, net.eff)
        return PassTimes(f=gather, b=2 * gather)
    heads = max(kv, m.head_size * act * cp)
    exchange = collective_time("all_to_all", tokens * (2 * q + 2 * heads), group, net.gpu, net.eff)
    return PassTimes(f=exchange, b=exchange)


def pp_p2p(cfg: Config, net: Network) -> float:
    """Seconds of one boundary message (activation or gradient) when it is not hidden."""
    p, t = cfg.parallel, cfg.training
    if p.pp == 1 or net.overlap.pp_p2p:
        return 0.0
    act = 2 if t.dtype == "bf16" else 4
    shards = p.tp if p.sp else 1
    message = t.micro_batch * t.seq_len // p.cp // shards * cfg.model.dim * act
    return collective_time("p2p", message, _on(net, groups(cfg)["pp"]), net.gpu, net.eff)


def _engine_time(shapes: list[tuple[int, ...]], shard: Group, replicas: Group, cfg: Config, net: Network):
    """(per micro-batch forward, per micro-batch backward, after the last backward, after the step)
    seconds of one data-parallel engine's collectives, before any overlap."""
    p, t = cfg.parallel, cfg.training
    reduce = 2 if p.reduce_dtype == "bf16" else 4
    full = sum(math.prod(s) for s in shapes)
    if shard.size == 1:
        return 0.0, 0.0, collective_time("all_reduce", reduce * full, replicas, net.gpu, net.eff), 0.0
    padded = sum(math.ceil(s[0] / shard.size) * shard.size * math.prod(s[1:]) for s in shapes)
    replica = collective_time("all_reduce", reduce * padded / shard.size, replicas, net.gpu, net.eff)
    scatter = collective_time("reduce_scatter", reduce * padded, shard, net.gpu, net.eff)
    if p.zero == 3:
        gather = collective_time(
            "all_gather", (2 if t.dtype == "bf16" else 4) * padded, shard, net.gpu, net.eff
        )
        backward = gather * (1 if p.reshard_after_forward else 0) + scatter
        return gather, backward, replica, 0.0
    gather = collective_time("all_gather", 4 * padded, shard, net.gpu, net.eff)
    return 0.0, (scatter if p.zero == 2 else 0.0), (0.0 if p.zero == 2 else scatter) + replica, gather


def dp_comm(
    cfg: Config, pp_rank: int, net: Network, micro: int, mb: PassTimes, layers: int
) -> dict[str, float]:
    """Exposed data-parallel seconds per step on stage `pp_rank`; `mb` is one micro-batch's compute on
    the rank and `layers` its layer count (ZeRO-3's first layer's gather cannot be prefetched)."""
    p, o = cfg.parallel, net.overlap
    g = {name: _on(net, group) for name, group in groups(cfg).items()}
    params = rank_parameters(cfg, pp_rank)
    engines = [([x.shape for x in params if not x.expert or p.ep == 1], g["shard"])]
    if p.ep > 1:
        engines.append(([x.shape for x in params if x.expert], g["edp"]))
    exposed = 0.0
    bucket = p.bucket_mb * 2**20
    for shapes, shard in engines:
        forward, backward, last, after = _engine_time(shapes, shard, g["dp_replicate"], cfg, net)
        if p.zero == 3 and shard.size > 1 and o.fsdp_prefetch:
            first = (forward + backward) / max(layers, 1)
            exposed += micro * (max(0.0, forward - mb.f) + max(0.0, backward - mb.b - mb.w)) + first
        else:
            exposed += micro * (forward + backward)
        nbytes = 4 * sum(math.prod(s) for s in shapes)
        tail = last * min(1.0, bucket / nbytes) if nbytes else 0.0  # the last bucket waits for backward
        exposed += max(tail, last - mb.b - mb.w) if o.dp_reduce else last
        exposed += max(0.0, after - mb.f) if o.dp_gather else after
    return {"dp": exposed}
