"""Bytes one rank moves per optimizer step, per mesh group, as comm.py counts them (ring volumes:
an all-reduce of S bytes over n ranks 2·S·(n−1)/n, an all-gather or reduce-scatter of a full S
S·(n−1)/n, an all-to-all the rows that leave, a send or a receive S; docs/theory.md).

  data parallel   per engine (plan/state.py), over its flat of 4-byte gradients, P elements (padded:
                  ceil(d0/n) rows per parameter and rank):
                    DDP      one all-reduce of P (dp group)
                    ZeRO-1   one reduce-scatter + one all-gather of the padded flat
                    ZeRO-2   a reduce-scatter per micro-batch + one all-gather
                    ZeRO-3   per micro-batch an all-gather in forward, another in backward (when units
                             reshard after forward) and a reduce-scatter; the first rank of a V gathers
                             the root for each of its two chunks; SimpleFSDP per read of a parameter
                             (the embedding's lookup gathers once, a tied head and each MTP depth read
                             again)
                  replicas (dp_replicate) all-reduce each rank's padded shard once per step; the loss
                  (and each multi-token prediction depth's) and clipping's norm add an all-reduce of
                  1 + mtp_depth fp32 and of two float64 numbers
  tensor          per micro-batch and layer 4 all-reduces of a [tokens, dim] activation, 2 more around
                  the embedding and head; sp turns each into an all-gather and a reduce-scatter of the
                  same volume, and gathers each region's input again in backward (one more all-gather
                  per region); a recomputed block's rerun reduces the attention's output again
                  (`tp_rerun_units`); the vocab-parallel loss all-reduces 3 numbers per token
  expert          all-to-all dispatch: 4 exchanges of top_k·tokens·dim·(ep−1)/ep rows per MoE layer
                  and micro-batch under balanced routing, 2 of the rows' gates (there, and their
                  gradient back), plus the count table's all-gather; a capacity's E·C slots instead;
                  the all-gather dispatch's gathers and reduce-scatters; dedup: the same 4 of
                  r·tokens rows, r the ranks a token reaches (plan/routing.py), with each row's gates
                  and chosen-mask (and the gates' gradient); full recompute dispatches again, and so
                  does op recompute with op_recompute_dispatch = "rerun" (by default it keeps the
                  dispatch's outputs instead: comm/kept_outputs.py) (`_ep_bytes`)
  pipeline        per micro-batch and remote chunk boundary: the activation forward, its gradient
                  backward (one sent, the other received), plus the losses' and clipping's all-reduces

Tokens are this rank's: micro_batch·seq_len/cp. The data-parallel groups and the pipeline's are exact
(tests/test_plan.py checks them against the counted bytes of every engine and schedule), but for ZeRO-3
without resharding after forward on the first rank of a V (`exact_groups`); tp is a leading term, and
so is ep where routing sets the bytes (dropless all-to-all, dedup, hierarchical: at balanced routing);
the routing-free ep exchanges (a capacity's slots, the all-gather dispatch) are exact;
context parallel's ring, all-gather and all-to-all exchanges are exact for dense models (hybrid is not
modelled yet). `exact_groups` names the exact ones.
"""

from __future__ import annotations

import math

from meshtron.config.row_blocks import padded_numel
from meshtron.config.schema import V_SCHEDULES, Config, ModelConfig, TrainingConfig
from meshtron.plan.muon import muon_bytes
from meshtron.plan.routing import hierarchical_rows, ranks_per_token
from meshtron.plan.state import RankParameter, rank_parameters, row_block_elements
from meshtron.rules.data import micro_batches_per_step
from meshtron.schedules.actions import chunks_of_rank, rank_of_chunk

DATA_GROUPS = frozenset({"dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp", "pp_ends"})


def exact_groups(cfg: Config) -> frozenset[str]:
    """The groups whose `step_bytes` are exact on rank 0 of its data-parallel group, not leading terms.
    Not yet: ZeRO-3 without resharding after forward on the first rank of a V, whose two chunks keep
    the root unit gathered in turns that depend on the schedule's order. torch's fully_shard moves
    exactly what meshtron's units move (the same units; comm/fsdp2_counted.py counts its collectives),
    SimpleFSDP that and what its reads add (`_simple_fsdp_reads`), eager or compiled."""
    p = cfg.parallel
    dense_cp = {"cp"} if not cfg.model.is_moe and p.cp_impl != "hybrid" else set()
    out = DATA_GROUPS | {"pp"} | dense_cp | ({"ep"} if routing_free_ep(cfg) else set())
    if p.zero == 3 and p.pp > 1 and p.pp_schedule in V_SCHEDULES and not p.reshard_after_forward:
        out -= {"dp_shard", "dp_shard_cp"}
    return out


def routing_free_ep(cfg: Config) -> bool:
    """Whether the expert exchange's bytes do not depend on where tokens are routed: a capacity's slots
    under the all-to-all dispatch, or the all-gather dispatch."""
    p, m = cfg.parallel, cfg.model
    slots = p.ep_dispatch == "alltoall" and m.capacity_factor > 0
    return m.is_moe and p.ep > 1 and (slots or p.ep_dispatch == "allgather")


def _ring(n: int) -> float:
    return (n - 1) / n


def _dp_bytes(
    shapes: list[tuple[int, ...]], shard: int, replicate: int, cfg: Config, micro: int
) -> tuple[float, float]:
    """(shard-or-dp group, replicate group) bytes of one engine's gradient traffic per step."""
    p = cfg.parallel
    reduce = 2 if p.reduce_dtype == "bf16" else 4
    full = sum(math.prod(s) for s in shapes)
    if shard == 1:
        return 0.0, 2 * reduce * full * _ring(replicate)
    padded = sum(padded_numel(s, shard, cfg.training.optimizer != "muon") for s in shapes)
    gather = 2 if cfg.training.dtype != "fp32" else 4  # parameters gather in the compute dtype
    if p.zero == 3:
        per_micro = gather * (2 if p.reshard_after_forward else 1) + reduce
        volume = micro * per_micro * padded
    else:
        volume = ((micro if p.zero == 2 else 1) * reduce + gather) * padded
    return volume * _ring(shard), 2 * reduce * (padded / shard) * _ring(replicate)


def _v_root_regathers(cfg: Config, params: list[RankParameter], shard: int, micro: int) -> float:
    """ZeRO-3 on the first rank of a V (embedding and head on one rank): each of its two chunks gathers
    the root unit in forward and again in backward, two gathers more per micro-batch than a unit's."""
    root = [x.shape for x in params if not x.name.startswith(("layers.", "mtp."))]
    padded = sum(padded_numel(s, shard, cfg.training.optimizer != "muon") for s in root)
    gather = 2 if cfg.training.dtype != "fp32" else 4
    return micro * 2 * gather * padded * _ring(shard)


def _simple_fsdp_reads(
    cfg: Config, params: list[RankParameter], shard: int, micro: int, first: bool, last: bool
) -> float:
    """What SimpleFSDP moves beyond meshtron's units (which gather each parameter twice per micro-batch
    and reduce-scatter it once): it gathers a parameter on every read, again in backward where that
    read's backward needs the weight, and reduce-scatters each read's gradient. Reads that differ from
    one per unit: the embedding's lookup (its backward needs no weight: one gather fewer), a tied head
    reading the embedding's weight again, and each multi-token prediction depth's lookup and head call.
    (Recompute adds none: a rerun's gathers stand in for backward's.)"""
    sizes = {x.name: padded_numel(x.shape, shard, cfg.training.optimizer != "muon") for x in params}
    embed, head = sizes.get("tok_embeddings.weight", 0), sizes.get("output.weight", 0)
    depths = cfg.model.mtp_depth if last else 0
    lookups, head_calls = int(first) + depths, (1 + depths) if last else 0
    tied = head_calls if cfg.model.tie_embeddings else 0  # the head's reads of the embedding's weight
    gathers = embed * (lookups + 2 * tied - 2) + head * 2 * (head_calls - 1)
    reduces = embed * (lookups + tied - 1) + head * (head_calls - 1)
    gather, reduce = 2 if cfg.training.dtype != "fp32" else 4, 2 if cfg.parallel.reduce_dtype == "bf16" else 4
    return micro * (gather * gathers + reduce * reduces) * _ring(shard)


def cp_token_bytes(cfg: Config, element: int = 4) -> int:
    """What a ring hop or an all-gather carries per token of a layer: every key/value head's key and
    value (after the tp cut), or with cp_exchange = "latent" MLA's latent and rotary key."""
    m, p = cfg.model, cfg.parallel
    if p.cp_exchange == "latent":
        return (m.kv_lora_rank + m.qk_rope_head_dim) * element
    return m.kv_heads_per_rank(p.tp) * (m.head_size + m.value_size) * element


def _cp_bytes(cfg: Config, layers: int, micro: int) -> float:
    """Context parallel per step (docs/context-parallel.md#communication), b sequences of s tokens per
    micro-batch, kv and q the widths in bytes per token of what travels (cp_token_bytes: keys and
    values, or MLA's latents) and of the queries (after the tp cut):
      ring       kv sent and received around the ring forward and again backward, 2·2·b·s·kv·(cp−1)/cp
                 each way, plus the fp32 gradient accumulators' cp hops of 2·b·(s/cp)·kv each way
      allgather  kv all-gathered forward and backward, its gradient reduce-scattered
      alltoall   q, k, v, o and their gradients, 2·b·(s/cp)·(q + o + kv')·(cp−1)/cp, kv' with the key/value
                 heads replicated up to cp
    A recomputed attention (every recompute mode: op recompute keeps no attention output under cp) sends
    its forward exchange again in backward: the ring's kv, the gathered kv, or under alltoall q, k and v
    (and o, where the rerun is the whole block's or every op's, not the attention core's alone)."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    cp, b, s = p.cp, t.micro_batch, t.seq_len
    kv = cp_token_bytes(cfg)
    heads = m.n_heads // p.tp
    rerun = t.recompute != "none"
    if p.cp_impl == "ring":
        per_layer = (4 + 2 * rerun) * b * s * kv * _ring(cp) + 2 * cp * b * (s // cp) * kv
    elif p.cp_impl == "allgather":
        per_layer = (3 + rerun) * b * s * kv * _ring(cp)
    elif p.cp_impl == "alltoall":
        kv_rep = max(kv, (m.head_size + m.value_size) * 4 * cp)
        q, o = heads * m.head_size * 4, heads * m.value_size * 4
        rerun_width = (q + kv_rep + (o if t.recompute != "selective" else 0)) if rerun else 0
        per_layer = b * (s // cp) * (2 * (q + o + kv_rep) + rerun_width) * _ring(cp)
    else:
        return 0.0  # hybrid: not modelled yet
    return micro * layers * per_layer


def _outer_bytes(shapes: list[tuple[int, ...]], shard: int, replicate: int, cfg: Config) -> float:
    """DiLoCo's outer all-reduce of the fp32 rows rank 0 owns, averaged over the H steps it comes once in
    (train/diloco.py): DDP owns whole parameters, ZeRO-3 its padded row blocks, ZeRO-1/2 their rows."""
    cut, padded = cfg.training.optimizer != "muon", cfg.parallel.zero == 3
    owned = sum(math.prod(s) if shard == 1 else row_block_elements(s, shard, padded, cut) for s in shapes)
    return 2 * 4 * owned * _ring(replicate) / cfg.fault_tolerance.diloco_every


def step_bytes(cfg: Config, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """Bytes per group name (as the trainer's metrics name them) of one step on rank 0 of stage pp_rank."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    dp_shard = p.dp_shard_for(world_size)
    shard, dp = dp_shard * p.cp, p.dp_replicate * dp_shard
    micro = micro_batches_per_step(t.global_batch, t.micro_batch, dp)
    params = rank_parameters(cfg, pp_rank)
    first, last = _holds_ends(cfg, pp_rank)
    out: dict[str, float] = {}

    def add(group: str, nbytes: float) -> None:
        if nbytes:
            out[group] = out.get(group, 0.0) + nbytes

    cp = "_cp" if p.cp > 1 else ""
    dense = [x.shape for x in params if not x.expert or not p.experts_apart]
    on_shard, on_replicas = _dp_bytes(dense, shard, p.dp_replicate, cfg, micro)
    if p.zero == 3 and shard > 1 and p.pp > 1 and first and last:
        on_shard += _v_root_regathers(cfg, params, shard, micro)
    if p.zero == 3 and shard > 1 and p.fsdp_impl == "simple":
        on_shard += _simple_fsdp_reads(cfg, params, shard, micro, first, last)
    diloco = cfg.fault_tolerance.diloco_every
    if diloco:  # the outer step's fp32 all-reduce every H steps, and the replicas' largest clipping norm
        on_replicas = _outer_bytes(dense, shard, p.dp_replicate, cfg) + 2 * 4 * _ring(p.dp_replicate)
    if shard > 1:
        add(f"dp_shard{cp}", on_shard + 2 * 16 * _ring(shard))  # + clipping's two float64 partial sums
        add("dp_replicate", on_replicas)
    else:
        add("dp_replicate" if diloco else f"dp{cp}", on_replicas)
    losses = 1 + m.mtp_depth  # the loss, and each multi-token prediction depth's
    add(f"dp{cp}", 2 * 4 * losses * _ring(dp * p.cp))
    if p.pp > 1:  # the losses from the last stage, clipping's sums over the stages
        add("pp", 2 * 4 * losses * _ring(p.pp) + 2 * 16 * _ring(p.pp))
    if (m.tie_embeddings or m.mtp_depth) and p.pp > 1 and first != last:  # two copies' gradients summed
        rows = math.ceil(m.vocab_size / p.tp)
        owned = rows if shard == 1 else math.ceil(rows / shard)
        owned = owned if p.zero == 3 or shard == 1 else min(owned, rows)
        add("pp_ends", 2 * 4 * owned * m.dim * _ring(2))
    if p.experts_apart:
        on_edp, on_replicas = _dp_bytes(
            [x.shape for x in params if x.expert], p.edp_of(shard), p.dp_replicate, cfg, micro
        )
        add("edp", on_edp)
        experts = [x.shape for x in params if x.expert]
        add(
            "dp_replicate",
            _outer_bytes(experts, p.edp_of(shard), p.dp_replicate, cfg) if diloco else on_replicas,
        )
    for group, nbytes in muon_bytes(cfg, pp_rank, dp_shard).items():  # Muon's owners (plan/muon.py)
        add(group, nbytes)
    tokens = t.micro_batch * t.seq_len // p.cp
    layers = sum(1 for x in params if x.name.endswith("attention_norm.weight"))
    moe_layers = sum(1 for x in params if x.name.endswith("experts.w1"))
    if p.tp > 1:
        add("tp", micro * _tp_bytes(cfg, tokens, layers, first, last))
    if p.cp > 1:  # exact for dense models; an MoE layer adds its routing statistics' all-reduce
        add("cp", _cp_bytes(cfg, layers, micro))
    for group, nbytes in _ep_bytes(cfg, world_size, tokens).items():
        add(group, micro * moe_layers * nbytes)
    if p.pp > 1:
        seq_shards = p.tp if p.sp else 1
        message = t.micro_batch * t.seq_len // p.cp // seq_shards * m.dim * 4
        boundaries = _remote_edges(cfg, pp_rank)
        # Per micro-batch and remote boundary one message each way: the forward's activation, then its
        # gradient back; on this rank one is a send and the other a receive.
        add("pp", micro * 2 * boundaries * message)
    return out


def _tp_bytes(cfg: Config, tokens: int, layers: int, first: bool, last: bool) -> float:
    """Tensor parallel's bytes of one micro-batch on a stage of `layers` layers: 4 all-reduces of a
    [tokens, dim] activation per layer, one around the embedding and one around the head. sp gathers
    each region's input again in backward (half an all-reduce's volume), or a recomputed block's rerun
    does; the head's region always does. The vocab-parallel loss all-reduces 3 numbers per token."""
    p, m = cfg.parallel, cfg.model
    regather = 0.5 if p.sp else 0.0
    per_layer = 4 + 2 * regather + tp_rerun_units(cfg.training.recompute, p.sp)
    activation = 2 * tokens * m.dim * 4 * _ring(p.tp)
    loss = 3 * 2 * tokens * 4 * _ring(p.tp) if last else 0
    return (per_layer * layers + first + last * (1 + regather)) * activation + loss


def _ep_bytes(cfg: Config, world_size: int, tokens: int) -> dict[str, float]:
    """One MoE layer's expert-parallel bytes for one micro-batch of `tokens` tokens, by group: the
    dispatch's forward, the rest (combine, and both gradients), and where the rerun block dispatches
    again (`reruns_dispatch`) the dispatch's forward again (the rerun stops once backward's saved
    tensors are back, so its combine is not rerun). Rows travel in the compute dtype (act bytes), their
    gates alike.

      alltoall      top_k rows per token each way, with their gates, and the count table's all-gather;
                    with a capacity C, E·C rows (every expert's slots, C from all the layer's tokens)
                    and no table: the exchange no longer depends on the routing
      allgather     every rank's tokens, gates, expert ids (int64) and keep mask (uint8) gathered, the
                    fp32 sums reduce-scattered back; backward the reverse: also routing-free
      dedup, and each hop of hierarchical: one row per token and member holding its experts (plan/
                    routing.py), carrying the token, gates and chosen-mask there and the partial sum
                    back, with their gradients (no mask's), and the row counts' all-gather"""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if p.ep == 1:
        return {}
    act = 2 if t.dtype != "fp32" else 4
    rerun = reruns_dispatch(t)
    sent = tokens // (1 if p.expert_tp else p.tp)  # etp = 1: each tp rank sends its 1/tp of the tokens
    if p.ep_dispatch == "allgather":
        dispatch = sent * (m.dim * act + m.top_k * (act + 8 + 1)) * (p.ep - 1)
        rest = sent * (m.dim * (4 + act + 4) + m.top_k * act) * (p.ep - 1)
        return {"ep": (2 if rerun else 1) * dispatch + rest}
    if p.ep_dispatch == "alltoall":
        rows, counts = sent * m.top_k, 8 * m.n_experts * (p.ep - 1)
        if m.capacity_factor > 0:
            rows, counts = capacity_slots(m, tokens), 0
        dispatch = counts + rows * (m.dim + 1) * act * _ring(p.ep)
        return {"ep": (2 if rerun else 1) * dispatch + rows * (3 * m.dim + 1) * act * _ring(p.ep)}
    hops = [("ep", sent * ranks_per_token(m, p.ep), m.n_experts // p.ep, p.ep)]
    if p.ep_dispatch == "hierarchical":
        per_node = len(p.dims(world_size).ep_node_groups(cfg.run.gpus_per_node or world_size)[0][0])
        hops = hierarchical_rows(m, p.ep, per_node, sent)
    out = {}
    for group, rows, width, members in hops:
        counts = 8 * members * (members - 1)
        dispatch = counts + rows * _ring(members) * (m.dim * act + 4 * width + width)
        out[group] = (2 if rerun else 1) * dispatch + rows * _ring(members) * (3 * m.dim * act + 4 * width)
    return out


def tp_rerun_units(recompute: str, sp: bool) -> float:
    """All-reduces of a layer's [tokens, dim] activation (an all-gather and a reduce-scatter each under
    sp) that a recomputed block's rerun adds in backward. The rerun stops once backward's saved tensors
    are back, before the FFN's (or MoE's) exit, so it reduces the attention's output again: an
    all-reduce (1), or under sp a reduce-scatter (1/2), its all-gathers standing in for the regathers
    backward would do anyway; op recompute under sp keeps that reduce-scatter's output instead
    (comm/kept_outputs.py), so adds nothing."""
    if recompute == "full":
        return 0.5 if sp else 1.0
    if recompute == "op":
        return 0.0 if sp else 1.0
    return 0.0


def reruns_dispatch(t: TrainingConfig) -> bool:
    """Whether a recomputed MoE block sends its forward dispatch again in backward: under full recompute,
    and under op recompute when told not to keep what the dispatch delivered."""
    return t.recompute == "full" or (t.recompute == "op" and t.op_recompute_dispatch == "rerun")


def capacity_slots(m: ModelConfig, tokens: int) -> int:
    """Rows an MoE layer's all-to-all sends each way under a capacity: every expert's C slots, C =
    ceil(factor·tokens·top_k / E) over the layer's `tokens` (models/moe.py `MoE.capacity`)."""
    return m.n_experts * math.ceil(m.capacity_factor * tokens * m.top_k / m.n_experts)


def _holds_ends(cfg: Config, pp_rank: int) -> tuple[bool, bool]:
    """Whether stage `pp_rank` holds the first chunk (embedding) and the last (head and loss)."""
    p = cfg.parallel
    chunks = chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
    return 0 in chunks, p.pp * p.vpp - 1 in chunks


def _remote_edges(cfg: Config, pp_rank: int) -> int:
    """Chunk boundaries this rank sends across to another rank (a V's turn stays on its rank)."""
    p = cfg.parallel
    n = p.pp * p.vpp
    return sum(
        rank_of_chunk(other, p.pp, p.pp_schedule) != pp_rank
        for c in chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
        for other in (c - 1, c + 1)
        if 0 <= other < n
    )
