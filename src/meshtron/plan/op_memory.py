"""What a layer keeps under per-operation recompute (`training.recompute = "op"`, parallel/recompute.py).

The block keeps its input (the checkpoint's) and the outputs of the operations its policy stores; every
other tensor of the block's forward is made again in backward. In the order the forward runs them, with
T = s·b the tokens of this rank (s/cp per sequence under context parallel), t = tp, q = n_heads·head_dim,
k the key/value width held per rank, f the FFN width, the matmuls' outputs are:

  attention     q, k, v projections T·q/t, T·k, T·k; the output projection T·h (a row-parallel partial
                sum: whole h on every tp rank, reduced after)
  MLA           the query latent T·q_lora and its up-projection T·H·(N + R)/t (or one projection without
                a query latent), the key/value latent T·(C + R) (both latents T/t under sp with a query
                latent: each rank projects its own tokens down), its up-projection T·H·(N + Dv)/t (inside
                the attention core, so recomputed, when context parallel exchanges latents), the output
                projection T·h
  dense FFN     gate and up T·f/t each, down T·h (partial)
  MoE           the router's scores T·E (fp32: it computes in fp32); the shared expert's gate, up
                T·f_s/t and down T·h; its sigmoid gate's projection T; the routed experts' gate and up
                M·e each over the M rows they process (e = expert FFN width per rank). Their
                down-projection's output is not kept: the gate values are folded in before it, nothing
                after it saves a tensor, and so the rerun stops before it (models/moe.py)

"matmuls" keeps them all, "every_other_matmul" the first, third, fifth... in that order (torchtitan's
trade of memory for a little recompute), "matmuls_but_mla_up" all but MLA's two up-projections
(DeepSeek-V3's: their outputs are made again from the kept latents). Without context parallel the
attention kernel's output T·q/t (MLA's padded to N + R per head: models/attention.py) and log-sum-exp
b·(a/t)·s (fp32) are kept too; under cp the attention core is a ring of partial blocks (or a tiled path
whose matmuls are score tiles), so it is recomputed whole and none of it is kept. The input is T·h, or
T·h/t under sequence parallel, where the reduce-scatter after the attention's output projection keeps
its output T·h/t too (comm/kept_outputs.py: the rerun reads it instead of reducing again). M comes from
the routing as in plan/memory.py: balanced by default, the measured count when given; with a capacity
under the all-to-all dispatch (ep > 1) it is every capacity slot of the ep group's experts, E·C.
"""

from __future__ import annotations

import math

from meshtron.config.schema import EpDispatch, ModelConfig, OpRecomputeSaves
from meshtron.plan.routing import hierarchical_rows, ranks_per_token

# (elements, whether they are fp32 whatever the activation dtype) of each stored output, in forward order.
Outputs = list[tuple[int, bool]]


def _attention_matmuls(
    cfg: ModelConfig, tokens: int, tp: int, sp: bool, up_kept: tuple[bool, bool]
) -> Outputs:
    if cfg.is_mla:
        return _latent_matmuls(cfg, tokens, tp, sp, *up_kept)
    q = cfg.n_heads * cfg.head_size // tp
    k = cfg.kv_heads_per_rank(tp) * cfg.head_size
    return [(tokens * q, False), (tokens * k, False), (tokens * k, False), (tokens * cfg.dim, False)]


def _latent_matmuls(cfg: ModelConfig, tokens: int, tp: int, sp: bool, q_up: bool, kv_up: bool) -> Outputs:
    """MLA's (models/latent_attention.py): the latents' down-projections whole on every tp rank (on
    this rank's 1/tp of the tokens under sp with a query latent: the latents enter the region), the
    up-projections of this rank's heads where they are kept (`q_up`, `kv_up`), the output projection's
    partial sum."""
    heads = cfg.n_heads // tp
    down = tokens // tp if sp and cfg.q_lora_rank else tokens
    if cfg.q_lora_rank:
        queries = [(down * cfg.q_lora_rank, False)] + [(tokens * heads * cfg.head_size, False)] * q_up
    else:
        queries = [(tokens * heads * cfg.head_size, False)]
    latents = [(down * (cfg.kv_lora_rank + cfg.qk_rope_head_dim), False)]
    up = [(tokens * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False)] * kv_up
    return [*queries, *latents, *up, (tokens * cfg.dim, False)]


def _moe_matmuls(cfg: ModelConfig, tokens: int, tp: int, expert_tp: bool, rows: int) -> Outputs:
    """In the order models/moe.py runs them: the router, the shared expert (and its gate's projection),
    the routed experts' gate and up (their down-projection's output is not kept)."""
    e = cfg.expert_ffn_dim // tp if expert_tp else cfg.expert_ffn_dim
    out = [(tokens * cfg.n_experts, True)]
    if cfg.n_shared_experts:
        s = cfg.shared_expert_ffn_dim // tp
        out += [(tokens * s, False), (tokens * s, False), (tokens * cfg.dim, False)]
        if cfg.shared_expert_gate:
            out.append((tokens, False))
    return out + [(rows * e, False), (rows * e, False)]


def op_kept_elements(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int,
    sp: bool,
    cp: int,
    saves: OpRecomputeSaves,
    moe_rows: int | None,
    expert_tp: bool = True,
    latent_exchange: bool = False,
) -> tuple[int, int]:
    """(elements in the activation dtype, fp32 elements) one layer keeps; `seq` is the whole sequence
    (divided by cp here); `moe_rows`: the rows its experts process (None: a dense layer);
    `latent_exchange`: context parallel exchanges MLA's latents (their up-projection is in the core)."""
    seq //= cp
    tokens = batch * seq
    # MLA's up-projections, kept unless the policy recomputes them (the keys' and values' one is inside
    # the attention core when context parallel exchanges latents: recomputed too)
    up = saves != "matmuls_but_mla_up"
    outputs = _attention_matmuls(cfg, tokens, tp, sp, (up, up and not latent_exchange))
    if moe_rows is None:
        f = cfg.ffn_dim // tp
        outputs += [(tokens * f, False), (tokens * f, False), (tokens * cfg.dim, False)]
    else:
        outputs += _moe_matmuls(cfg, tokens, tp, expert_tp, moe_rows)
    kept = outputs[::2] if saves == "every_other_matmul" else outputs
    floats = sum(n for n, fp32 in kept if not fp32) + (tokens * cfg.dim // tp if sp else tokens * cfg.dim)
    if sp and tp > 1:  # the attention's reduce-scattered output
        floats += tokens * cfg.dim // tp
    fp32 = sum(n for n, is_fp32 in kept if is_fp32)
    if cp == 1:  # the attention kernel's output and log-sum-exp
        floats += tokens * cfg.n_heads * cfg.head_size // tp
        fp32 += batch * (cfg.n_heads // tp) * seq
    return floats, fp32


def dispatch_kept_elements(
    cfg: ModelConfig,
    tokens: int,
    ep: int,
    ep_dispatch: EpDispatch,
    rows: int,
    pairs: int | None = None,
    per_node: int = 0,
    crossed: int | None = None,
) -> tuple[int, int, int, int]:
    """(elements in the activation dtype, fp32, int64, bool) of what the expert dispatch delivered to
    this rank, which recompute = "op" keeps for the rerun instead of sending it again
    (comm/kept_outputs.py): `tokens` the rows this rank sends (its tp share under etp = 1), `rows` those
    its experts process (received: each rank receives what it sends when balanced), `pairs` the dedup
    dispatch's (token, rank) rows (plan/routing.py's expectation when None). Nothing with ep = 1.

      alltoall      the count table ep·E (int64), the rows and their gates M·(h + 1); with a capacity
                    the E·C slots and their gates
      allgather     every rank's tokens ep·T·h, gates ep·T·k, expert ids ep·T·k (int64), keep mask
      dedup         the row counts ep² (int64), the rows P·h, their gates for the rank's L = E/ep
                    experts P·L (fp32) and which of them are chosen P·L (uint8)
      hierarchical  each hop's as dedup's over its members (plan/routing.py hierarchical_rows): the rows
                    that crossed the network, one per token and node holding its experts, with gates
                    and mask for the node's `per_node`·L experts; then the in-node hop's (all of it
                    when `per_node` is 0 or ep: one node)"""
    if ep == 1:
        return 0, 0, 0, 0
    h, k = cfg.dim, cfg.top_k
    if ep_dispatch == "allgather":
        every = ep * tokens
        return every * (h + k), 0, every * k, every * k
    if ep_dispatch == "alltoall":
        table = 0 if cfg.capacity_factor > 0 else ep * cfg.n_experts
        return rows * (h + 1), 0, table, 0
    pairs = expected_pairs(cfg, tokens, ep) if pairs is None else pairs
    local = cfg.n_experts // ep
    if ep_dispatch != "hierarchical" or per_node in (0, ep):
        return pairs * h, pairs * local, ep * ep, pairs * local
    (_, expected, width, nodes), _ = hierarchical_rows(cfg, ep, per_node, tokens)
    crossed = round(expected) if crossed is None else crossed
    return (
        (crossed + pairs) * h,
        crossed * width + pairs * local,
        nodes * nodes + per_node * per_node,
        crossed * width + pairs * local,
    )


def expected_pairs(cfg: ModelConfig, tokens: int, ep: int) -> int:
    """The dedup dispatch's (token, rank) rows for `tokens` sent tokens at balanced routing."""
    return round(tokens * ranks_per_token(cfg, ep))


def slot_rows(cfg: ModelConfig, tokens: int, ep: int, ep_dispatch: EpDispatch) -> int | None:
    """The rows every expert pass processes when they are fixed: the capacity slots of the all-to-all
    dispatch with a capacity (ep > 1), E·C with C the capacity of the micro-batch's `tokens` (whatever
    share of them the rank sends); None when they follow the routing."""
    if ep > 1 and ep_dispatch == "alltoall" and cfg.capacity_factor > 0:
        return cfg.n_experts * math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)
    return None
