"""Activation memory a transformer layer keeps for backward, tensor by tensor.

Korthikanti et al. (2022) count, for a GPT layer in 16-bit with dropout and an unfused attention, the
tensors backward needs: s·b·h·(34 + 5·a·s/h) bytes, 34/t with tensor + sequence parallel, 2·s·b·h
with full recompute (docs/theory.md#activation-memory). The same accounting applied to meshtron's block (RMSNorm, rotary
embedding, a fused attention kernel, SwiGLU, no dropout) gives, per layer, in elements (times the
activation dtype's bytes), with t the tensor-parallel degree, q = n_heads·head_dim, k the key/value
width held per rank, f the FFN width:

  each RMSNorm      its input, the 1/rms statistic, the normalised x and the weighted output
                    3·s·b·h + s·b           (with sp all of it 1/t: the projections keep the shard of
                                             their all-gathered input and gather it again in backward,
                                             as Megatron does)
  attention         rotated q and k, v, the kernel's output (which is also the output projection's
                    input) and its log-sum-exp: s·b·(2q/t + 2k) + b·(a/t)·s
  SwiGLU            gate and up projections and their product silu(gate)·up, the down-projection's
                    input (one fused op keeps gate and up and makes silu again: models/layers.py)
                    3·s·b·f/t
  full recompute    the block input only: s·b·h (s·b·h/t with sp)
  op recompute      the block input and every (or every other) matmul's output, and without cp the
                    attention kernel's output and log-sum-exp (plan/op_memory.py)
  selective         rotary embedding and attention rerun: q and k before rotation are kept instead of
                    after (the same size), the log-sum-exp is not, and the kernel's output is kept anyway
                    as the output projection's input: minus b·(a/t)·s only. With a fused kernel there is
                    no score matrix left for selective recompute to drop.

Context parallel (cp ranks, each holding s/cp tokens of every sequence) divides every term by cp: its
attention keeps the same tensors for its own tokens (rotated q and k, v, the output, the log-sum-exp),
the exchanged K/V blocks are freed after each step and fetched again in backward. One exception: the
all-to-all implementations (Ulysses degree u) keep the attention output twice, head-split for their
own backward and sequence-split for the output projection's (s·b·q/t more), and with fewer key/value
heads per tp rank than u they keep k and v replicated to u heads.

The 5·a·s² score term is absent: the fused kernel never materialises the scores. As in Megatron, the
all-gathered input of the column-parallel projections is not kept under sequence parallel: they keep
its sequence shard and gather it again in backward (comm/saved_gathers.py), so with tp + sp every
term of a layer is 1/t.

An MoE layer keeps the same norms and attention; its feed-forward depends on the routing. With T = s·b
the tokens every tp rank routes (all-gathered under sp), E experts, k = top_k, e the expert FFN width
per rank (e/t: split over tp like the dense FFN), N the assignments of this rank's tokens that it sorts
and combines and M those its experts process. Balanced routing (each expert chosen T·k/E times; under
capacity C = ceil(factor·T·k/E), min(T·k/E, C) kept) gives N = M = T·k dropless, N = M = min(T·k, E·C)
with capacity, on one device and on every ep rank alike (each receives what it sends); with etp = 1
(whole experts, E/t per tp rank) 1/t of that. `kept` and `assignments` take measured counts instead.
Indices are int64, the grouped matmuls' offsets int32, the gate values fp32:

  router            its scores T·E, the chosen experts' ids T·k (int64); the chosen scores and their
                    sum T·k + T when renormalised; the sigmoid scores' sum T; with the z-loss the
                    logits and their log-sum-exp T·E + T; the balance statistics 4·G·E + G + 2
                    (G = b for the per-sequence loss, else 1)
  routed experts    the gathered token rows M·h; the gate and up projections 2·M·e and each row's gate
                    value M (fp32), which the weighted SwiGLU keeps (it makes its product again in
                    backward); the down-projection's input M·e; each grouped matmul's offsets 3·E/ep
                    (int32; 3·E/(ep·t) with etp = 1); the row ids of the tokens' gather and of the
                    gates' 2·N (int64), and under the all-to-all dispatch the regrouping by local
                    expert M (int64)
  combine           nothing: the outputs come weighted (the gate folded in before the
                    down-projection, models/moe.py) and their sum per token keeps only row ids
  shared experts    SwiGLU 3·T·f_s/t; with the sigmoid gate, the gate T and the shared output T·h
  full recompute    the block input only, as dense
  op recompute      the block input and the outputs its policy keeps (plan/op_memory.py), as dense,
                    and under ep what the dispatch delivered (its rerun takes it instead of sending again)

The all-gather dispatch sorts and combines every ep rank's rows for its own experts: N = M there.

The pipeline's ends, beside the batch's own token ids and targets (which the embedding and the loss keep):

  embedding         nothing on one device; vocab-parallel, the ids shifted into this rank's range
                    (int64) and the mask of those it holds (bool): s·b each
  rotary tables     cos and sin, 2·s·b·d (d = head_dim), once per model chunk (each pipeline chunk forms
                    its own), kept by its blocks whatever the recompute
  head              the final norm as in a block (its output is the output projection's input); the
                    logits themselves are not kept, the loss's fp32 log-probabilities are: s·b·V (and
                    a 0-d total weight); vocab-parallel, this rank's softmax s·b·ceil(V/t) in fp32 with
                    its clamped target ids (int64) and in-range mask (bool)

Every count is exact in fp32 (tests/test_activation_memory.py). Under bf16 autocast the norms and the
residual stream stay fp32 and every projection keeps bf16 copies of its input and weight, which
`dtype_bytes` does not model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.config.schema import EpDispatch, ModelConfig, OpRecomputeSaves, Recompute, TrainingDType
from meshtron.plan.op_memory import dispatch_kept_elements, expected_pairs, op_kept_elements, slot_rows


@dataclass(frozen=True)
class SavedElements:
    """Elements kept for backward, by what decides their size: `floats` in the activation dtype, `fp32`
    in fp32 whatever it is (the combine's weighted expert outputs, the loss's probabilities), `int64`
    indices, `int32` grouped-matmul offsets, `bools` masks."""

    floats: int = 0
    fp32: int = 0
    int64: int = 0
    int32: int = 0
    bools: int = 0

    def __add__(self, other: SavedElements) -> SavedElements:
        return SavedElements(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, int, int, int, int]:
        return self.floats, self.fp32, self.int64, self.int32, self.bools

    @property
    def elements(self) -> int:
        return sum(self.astuple())

    def bytes(self, dtype_bytes: int = 4) -> int:
        return self.floats * dtype_bytes + 4 * self.fp32 + 8 * self.int64 + 4 * self.int32 + self.bools


def _norm_elements(sb: int, h: int, tp: int, sp: bool) -> int:
    """One RMSNorm entering a tensor-parallel region, on `sb` tokens (under sp all of it 1/t: the
    projections keep the shard of its output and gather it again in backward)."""
    return (3 * sb * h + sb) // tp if sp else 3 * sb * h + sb


def _latents_exchanged(exchange: str, cp: int, ulysses: int) -> bool:
    """Whether context parallel exchanges MLA's latents (parallel/context_latent.py: ring or all-gather)."""
    return exchange == "latent" and cp > 1 and ulysses == 1


def _latent_attention(
    cfg: ModelConfig, sb: int, tp: int, sp: bool, recompute: Recompute, where: tuple
) -> int:
    """MLA's attention of a block (models/latent_attention.py), `sb` tokens on the rank: its latents' norms
    (whole under tp, their inputs gathered and kept as the shard under sp when they enter the region), then
    per head what the kernel keeps. `where` = (cp, ulysses, exchange). Per token, with H/t heads, Dk =
    N + R:
      SDPA (cp 1)      q, k, v padded to Dk, the output padded, the output projection's copy of its
                       unpadded part, the log-sum-exp: H/t·(4·Dk + Dv + 1)
      cp, keys/values  q, k, the up-projection's output (v is a view of it), the output, lse
      cp, latents      q, the latents [c, k_rot], the output, lse; wkv_b does not keep its input
      selective        q and the up-projection's output as the core's inputs, the output"""
    cp, ulysses, exchange = where
    H, Dk, Dv, N = cfg.n_heads // tp, cfg.head_size, cfg.v_head_dim, cfg.qk_nope_head_dim
    ql, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shard = tp if sp and ql else 1  # the latents enter the tp region: gathered, kept as the shard
    latent = _latents_exchanged(exchange, cp, ulysses)
    queries = (ql // shard + 1 + 2 * ql) if ql else 0
    keys = (C + R) // shard + 1 + C + (0 if latent and recompute != "selective" else C)
    if recompute == "selective":
        heads = H * Dk + H * Dv + (0 if latent else H * (N + Dv))
    elif latent:
        heads = H * Dk + C + R + H * Dv + H
    elif ulysses > 1:  # exchanged copies of q, k, v; the output head-split and sequence-split
        heads = H * (2 * Dk + Dv) + 2 * H * Dv + H
    elif cp > 1:
        heads = 2 * H * Dk + H * (N + Dv) + H * Dv + H
    else:
        heads = H * (4 * Dk + Dv + 1)
    return sb * (queries + keys + heads)


def _attention_and_norms(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int,
    sp: bool,
    recompute: Recompute,
    ulysses: int,
    cp: int = 1,
    exchange: str = "kv",
) -> int:
    """Both norms and the attention of a block (not fully recomputed), `seq` tokens per sequence."""
    sb, h, a = seq * batch, cfg.dim, cfg.n_heads
    if cfg.is_mla:
        latent = _latent_attention(cfg, sb, tp, sp, recompute, (cp, ulysses, exchange))
        return 2 * _norm_elements(sb, h, tp, sp) + latent
    q = cfg.n_heads * cfg.head_size
    kv_heads = cfg.kv_heads_per_rank(tp)
    attention = sb * (2 * q // tp + 2 * kv_heads * cfg.head_size) + batch * (a // tp) * seq
    if ulysses > 1 and recompute == "none":  # (selective recompute keeps the inputs, before the exchange)
        # Ulysses keeps k and v with the key/value heads it had to replicate, and its output twice:
        # head-split for its own backward, sequence-split for the output projection's.
        attention += sb * (2 * (max(kv_heads, ulysses) - kv_heads) * cfg.head_size + q // tp)
    if recompute == "selective":
        attention -= batch * (a // tp) * seq
    return 2 * _norm_elements(sb, h, tp, sp) + attention


def _is_moe(cfg: ModelConfig, layer: int | None) -> bool:
    return cfg.is_moe if layer is None else cfg.is_moe_layer(layer)


def layer_activation_elements(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
    cp: int = 1,
    ulysses: int = 1,
    layer: int | None = None,
    ep: int = 1,
    op_saves: OpRecomputeSaves = "matmuls",
    exchange: str = "kv",
) -> int:
    """Elements one transformer layer keeps for backward on one rank of tp x cp (`ulysses`: the
    all-to-all degree of context parallel, cp for cp_impl="alltoall"). `layer`: which layer (None: an
    MoE layer if the model has any); an MoE layer counts its balanced routing over `ep` ranks, in
    elements of mixed dtypes (`moe_layer_activation_elements` has them by dtype, for bytes). `op_saves`:
    what recompute = "op" keeps (plan/op_memory.py); `exchange`: parallel.cp_exchange (MLA's latents)."""
    if _is_moe(cfg, layer):
        kept = moe_layer_activation_elements(
            cfg, batch, seq, tp, sp, recompute, cp, ulysses, ep, op_saves=op_saves, exchange=exchange
        )
        return kept.elements
    if recompute == "op":
        latent = _latents_exchanged(exchange, cp, ulysses)
        return sum(op_kept_elements(cfg, batch, seq, tp, sp, cp, op_saves, None, latent_exchange=latent))
    seq //= cp
    if recompute == "full":
        return seq * batch * cfg.dim // tp if sp else seq * batch * cfg.dim
    swiglu = 3 * seq * batch * cfg.ffn_dim // tp
    return _attention_and_norms(cfg, batch, seq, tp, sp, recompute, ulysses, cp, exchange) + swiglu


def balanced_assignments(cfg: ModelConfig, tokens: int) -> int:
    """(token, expert) assignments the router keeps of `tokens` when every expert is chosen T·k/E times:
    all T·k dropless, at most the capacity C = ceil(factor·T·k/E) of each expert otherwise."""
    routed = tokens * cfg.top_k
    if cfg.capacity_factor <= 0:
        return routed
    return min(routed, cfg.n_experts * math.ceil(cfg.capacity_factor * routed / cfg.n_experts))


def moe_layer_activation_elements(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
    cp: int = 1,
    ulysses: int = 1,
    ep: int = 1,
    ep_dispatch: EpDispatch = "alltoall",
    expert_tp: bool = True,
    kept: int | None = None,
    assignments: int | None = None,
    op_saves: OpRecomputeSaves = "matmuls",
    exchange: str = "kv",
    pairs: int | None = None,
    op_keeps_dispatch: bool = True,
    ep_per_node: int = 0,
    crossed: int | None = None,
) -> SavedElements:
    """What one MoE layer keeps for backward on one rank, by dtype. Routing is assumed balanced unless
    given: `kept`, the assignments of this rank's tokens it sorts and combines (all of them, or under
    etp = 1 (`expert_tp` False) those to its tp rank's experts); `assignments`, those its experts
    process (`kept` again when balanced: each ep rank receives what it sends); `pairs`, under the dedup
    dispatch the (token, rank) rows it sends, or under recompute = "op" those delivered to it, which
    the block keeps (plan/routing.py's expectation when not given); `op_keeps_dispatch`, under
    recompute = "op", whether the block keeps what the dispatch delivered
    (training.op_recompute_dispatch); `ep_per_node`, the hierarchical dispatch's ep ranks per node
    (0: the ep group on one node); `crossed`, the rows its network hop delivered (op_memory.py)."""
    seq //= cp
    tokens = batch * seq  # every tp rank routes all of them (gathered under sp)
    if recompute == "full":
        return SavedElements(floats=tokens * cfg.dim // tp if sp else tokens * cfg.dim)
    share = 1 if expert_tp else tp  # etp = 1: each tp rank sends 1/tp of the tokens to whole experts
    kept = balanced_assignments(cfg, tokens) // share if kept is None else kept
    assignments = kept if assignments is None else assignments
    if recompute == "op":
        slots = slot_rows(cfg, tokens, ep, ep_dispatch)
        rows = assignments if slots is None or kept is not None else slots
        latent = _latents_exchanged(exchange, cp, ulysses)
        floats, fp32 = op_kept_elements(cfg, batch, seq * cp, tp, sp, cp, op_saves, rows, expert_tp, latent)
        kept_op = SavedElements(floats=floats, fp32=fp32)
        if not op_keeps_dispatch:
            return kept_op
        delivered = dispatch_kept_elements(
            cfg, tokens // share, ep, ep_dispatch, rows, pairs, ep_per_node, crossed
        )
        return kept_op + SavedElements(*delivered[:3], bools=delivered[3])
    if ep > 1 and ep_dispatch == "allgather":
        kept = assignments  # every rank's tokens gathered: it sorts and combines what its experts process
    ffn = cfg.expert_ffn_dim if not expert_tp else cfg.expert_ffn_dim // tp
    if ep > 1 and ep_dispatch == "alltoall" and cfg.capacity_factor > 0:
        routed = _capacity_slot_elements(
            cfg, tokens, ffn, share, assignments=None if kept is None else assignments
        )
    elif ep > 1 and ep_dispatch in ("dedup", "hierarchical"):  # hierarchical: its in-node hop's (approx.)
        pairs = expected_pairs(cfg, tokens // share, ep) if pairs is None else pairs
        routed = _dedup_elements(cfg, tokens // share, ffn, assignments, pairs, cfg.n_experts // ep)
    else:
        # Gathered rows for the experts (regrouped by local expert under all-to-all), the weighted
        # SwiGLU's gate, up and gate value, the down-projection's input, the offsets of each of the 3
        # grouped matmuls; the row ids of the token gather and of the gate gather.
        routed = SavedElements(
            floats=assignments * (cfg.dim + 3 * ffn),
            fp32=assignments,
            int64=2 * kept + (assignments if ep > 1 and ep_dispatch == "alltoall" else 0),
            int32=3 * cfg.n_experts // ep,
        )
    attention = SavedElements(
        floats=_attention_and_norms(cfg, batch, seq, tp, sp, recompute, ulysses, cp, exchange)
    )
    return (
        attention + _router_elements(cfg, batch, tokens) + routed + _shared_expert_elements(cfg, tokens, tp)
    )


def _dedup_elements(
    cfg: ModelConfig, tokens: int, ffn: int, assignments: int, pairs: int, local: int
) -> SavedElements:
    """The dedup dispatch (parallel/expert.py): on the experts' rank the rows, the weighted SwiGLU's
    gate and up and the down-projection's input A·(h + 3·e), each assignment's gate A (fp32) and its row
    and expert (2·A, int64), the offsets; on the tokens' rank each row's token and rank (2·P, int64) and
    the gates' scatter: its index and mask (T·k each)."""
    routed = tokens * cfg.top_k
    return SavedElements(
        floats=assignments * (cfg.dim + 3 * ffn),
        fp32=assignments,
        int64=routed + 2 * pairs + 2 * assignments,
        int32=3 * local,
        bools=routed,
    )


def _capacity_slot_elements(
    cfg: ModelConfig, tokens: int, ffn: int, share: int, assignments: int | None
) -> SavedElements:
    """The all-to-all dispatch with a capacity (parallel/expert.py, `slots`): the experts process every
    slot, M = E·C rows, filled or not (`assignments` if measured; C the capacity of all `tokens`), with
    its gate value (0 if empty); each slot's token id (M + 1, int64), each of the A = T·k/share
    assignments' slot (A, int64), the experts' rows, gate and up and the down-projection's input
    M·(h + 3·e), the slots' gates M (fp32). The weighted outputs come back and are summed: nothing kept."""
    capacity = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)
    rows = cfg.n_experts * capacity if assignments is None else assignments
    routed = tokens // share * cfg.top_k
    return SavedElements(floats=rows * (cfg.dim + 3 * ffn), fp32=rows, int64=routed + rows + 1)


def _router_elements(cfg: ModelConfig, batch: int, tokens: int) -> SavedElements:
    """The router and its losses on `tokens` tokens of `batch` sequences."""
    t, e, k = tokens, cfg.n_experts, cfg.top_k
    floats = t * e  # softmax / sigmoid scores
    if cfg.router_norm_topk:
        floats += t * k + t  # the chosen scores and their sum
    if cfg.router == "sigmoid":
        floats += t  # the scores' sum that makes them probabilities for the balance loss
    if cfg.z_loss_coef:
        floats += t * e + t  # logits and their log-sum-exp
    groups = batch if cfg.balance_loss == "sequence" else 1
    floats += 4 * groups * e + groups + 2  # the statistics vector, two [G, E] quotients, token count
    return SavedElements(floats=floats, int64=t * k)  # int64: the chosen experts (the gather's index)


def _shared_expert_elements(cfg: ModelConfig, tokens: int, tp: int) -> SavedElements:
    """The shared experts' SwiGLU (its input is the norm's output) and the optional sigmoid gate."""
    if not cfg.n_shared_experts:
        return SavedElements()
    floats = 3 * tokens * cfg.shared_expert_ffn_dim // tp
    if cfg.shared_expert_gate:
        floats += tokens + tokens * cfg.dim  # sigmoid(gate) and the (partial) shared output it scales
    return SavedElements(floats=floats)


def embedding_activation_elements(
    cfg: ModelConfig, batch: int, seq: int, tp: int = 1, cp: int = 1
) -> SavedElements:
    """What the token embedding keeps besides the batch's own token ids (its index on one device): under
    tp, the ids shifted into this rank's vocabulary range and the mask of those it holds."""
    tokens = batch * seq // cp
    return SavedElements(int64=tokens, bools=tokens) if tp > 1 else SavedElements()


def rotary_table_elements(cfg: ModelConfig, batch: int, seq: int, cp: int = 1) -> int:
    """cos and sin [B, S, Dh], formed once per model chunk (each pipeline chunk its own) and kept by its
    blocks, recomputed or not."""
    return 2 * batch * (seq // cp) * cfg.head_size


def head_activation_elements(
    cfg: ModelConfig, batch: int, seq: int, tp: int = 1, sp: bool = False, cp: int = 1
) -> SavedElements:
    """The final norm, the output projection and the cross-entropy, besides the batch's targets. The
    logits are not kept; the loss keeps their fp32 log-probabilities (softmax under tp: this rank's
    ceil(V/t) of the padded vocabulary, with its own clamped target ids and their in-range mask)."""
    tokens = batch * seq // cp
    norm = _norm_elements(tokens, cfg.dim, tp, sp)  # its output is the projection's input
    if tp == 1:
        return SavedElements(floats=norm, fp32=tokens * cfg.vocab_size + 1)  # + nll's total weight
    vocab = math.ceil(cfg.vocab_size / tp)
    return SavedElements(floats=norm, fp32=tokens * vocab, int64=tokens, bools=tokens)


def korthikanti_bytes(
    cfg: ModelConfig, batch: int, seq: int, tp: int = 1, sp: bool = False, recompute: Recompute = "none"
) -> float:
    """The paper's 16-bit GPT-layer figure for the same sizes (docs/theory.md#activation-memory), for comparison."""
    sbh, a, s, h, t = seq * batch * cfg.dim, cfg.n_heads, seq, cfg.dim, tp
    if recompute == "full":
        return 2 * sbh
    attention_scores = 5 * a * s / (h * t)
    if recompute == "selective":
        return sbh * (34 / t if sp else 10 + 24 / t)
    if sp:
        return sbh * (34 / t + attention_scores)
    return sbh * (10 + 24 / t + attention_scores) if t > 1 else sbh * (34 + 5 * a * s / h)


def layer_activation_bytes(
    cfg: ModelConfig, batch: int, seq: int, dtype_bytes: int = 4, layer: int | None = None, **kwargs
) -> int:
    """Bytes one layer keeps (`kwargs` as `layer_activation_elements`, or for an MoE layer as
    `moe_layer_activation_elements`: the routing counts too); exact in fp32 (`dtype_bytes` 4)."""
    if _is_moe(cfg, layer):
        return moe_layer_activation_elements(cfg, batch, seq, **kwargs).bytes(dtype_bytes)
    for moe_only in (
        "ep_dispatch",
        "expert_tp",
        "kept",
        "assignments",
        "pairs",
        "op_keeps_dispatch",
        "ep_per_node",
        "crossed",
    ):  # a dense layer of an MoE model
        kwargs.pop(moe_only, None)
    return layer_activation_elements(cfg, batch, seq, layer=layer, **kwargs) * dtype_bytes


def head_activation_bytes(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    dtype: TrainingDType = "fp32",
) -> int:
    """Bytes the final norm, head and loss keep (`head_activation_elements`); exact in fp32."""
    return head_activation_elements(cfg, batch, seq, tp, sp, cp).bytes(4 if dtype == "fp32" else 2)
