"""Parameters, gradients and optimizer state per rank, for any layout, without building anything.

`rank_parameters` lists the parameters one pipeline stage holds, each at the shape tensor and expert
parallel leave on a rank (the same cuts as parallel/tensor.py and parallel/expert.py: column / row
splits over tp, key/value heads replicated when fewer than tp, the vocabulary padded to a multiple of
tp, experts split over ep, and over tp too with etp = 1). `state_bytes` then applies the data-parallel
engine the layout gets (parallel/data_parallel.py), dense and expert parameters each over their own
group, with the engines' exact storage (engines/shard.py's dim-0 row blocks of ceil(d0/n) rows, zero-padded):

  engine (group of n)   parameters            gradients                      AdamW state (fp32 m, v;
                                                                             Muon's matrices: 4, not 8)
  DDP                   4·P                   4·P (bucket buffers)           8·P
  ZeRO-1                4·P                   4·P (full .grad, rows reduced) 8·owned rows
  ZeRO-2                4·P                   4·padded shard                 8·owned rows
  ZeRO-3 (FSDP)         4·padded shard        4·padded shard                 8·padded shard
                        (gathered in the compute dtype only while a unit runs)

P counts elements, owned rows are this rank's unpadded rows of each parameter and a padded shard is
sum over parameters of ceil(d0/n)·(row size). In bf16 (engines/mixed_precision.py) the engines with
whole parameters hold them in bf16 (2·P) beside the fp32 masters of their optimizer (4·P under DDP, 4·
owned rows padded under ZeRO-1/2), both counted as parameters; ZeRO-3's parameters are its fp32 shards.
The most loaded rank is rank 0 of each group, which holds full blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from meshtron.config.optimizer import is_muon_matrix
from meshtron.config.row_blocks import block_rows, row_shape
from meshtron.config.schema import Config, ModelConfig
from meshtron.plan.flops import layer_costs
from meshtron.schedules.actions import chunks_of_rank
from meshtron.schedules.balance import layer_split_of
from meshtron.utils.memo import Memo


@dataclass(frozen=True)
class RankParameter:
    name: str
    shape: tuple[int, ...]
    expert: bool = False


def _latent_attention_parameters(cfg: ModelConfig, p: str, tp: int) -> list[RankParameter]:
    """MLA's projections on a tp rank: the latents' down-projections whole, the heads' up-projections and
    the output split (parallel/tensor.py)."""
    d, heads, C, qk = cfg.dim, cfg.n_heads // tp, cfg.kv_lora_rank, cfg.head_size
    a = p + "attention."
    if cfg.q_lora_rank:
        query = [
            RankParameter(a + "wq_a.weight", (cfg.q_lora_rank, d)),
            RankParameter(a + "q_latent_norm.weight", (cfg.q_lora_rank,)),
            RankParameter(a + "wq_b.weight", (heads * qk, cfg.q_lora_rank)),
        ]
    else:
        query = [RankParameter(a + "wq.weight", (heads * qk, d))]
    return query + [
        RankParameter(a + "wkv_a.weight", (C + cfg.qk_rope_head_dim, d)),
        RankParameter(a + "kv_latent_norm.weight", (C,)),
        RankParameter(a + "wkv_b.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), C)),
        RankParameter(a + "wo.weight", (d, heads * cfg.v_head_dim)),
    ]


def _attention_parameters(cfg: ModelConfig, p: str, tp: int) -> list[RankParameter]:
    """Grouped-query attention's projections on a tp rank (or MLA's)."""
    if cfg.is_mla:
        return _latent_attention_parameters(cfg, p, tp)
    d, hd, t = cfg.dim, cfg.head_size, tp
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    kv_local = kv // t if cfg.kv_heads % t == 0 else kv  # fewer kv heads than tp: all kept
    out = [
        RankParameter(p + "attention.wq.weight", (q // t, d)),
        RankParameter(p + "attention.wk.weight", (kv_local, d)),
        RankParameter(p + "attention.wv.weight", (kv_local, d)),
        RankParameter(p + "attention.wo.weight", (d, q // t)),
    ]
    if cfg.qkv_bias:
        out += [
            RankParameter(p + f"attention.{w}.bias", (n,))
            for w, n in (("wq", q // t), ("wk", kv_local), ("wv", kv_local))
        ]
    if cfg.qk_norm:
        out += [
            RankParameter(p + "attention.q_norm.weight", (hd,)),
            RankParameter(p + "attention.k_norm.weight", (hd,)),
        ]
    return out


def _block_parameters(cfg: ModelConfig, layer: int, tp: int, ep: int, expert_tp: bool) -> list[RankParameter]:
    d, t = cfg.dim, tp
    p = f"layers.{layer}."
    out = [
        RankParameter(p + "attention_norm.weight", (d,)),
        RankParameter(p + "ffn_norm.weight", (d,)),
        *_attention_parameters(cfg, p, tp),
    ]
    if not cfg.is_moe_layer(layer):
        f = cfg.ffn_dim // t
        return out + [
            RankParameter(p + "feed_forward.w1.weight", (f, d)),
            RankParameter(p + "feed_forward.w3.weight", (f, d)),
            RankParameter(p + "feed_forward.w2.weight", (d, f)),
        ]
    experts, width = cfg.n_experts // ep, cfg.expert_ffn_dim // (t if expert_tp else 1)
    out += [RankParameter(p + "moe.router.weight", (cfg.n_experts, d))]
    out += [
        RankParameter(p + f"moe.experts.{w}", s, expert=True)
        for w, s in (("w1", (experts, width, d)), ("w3", (experts, width, d)), ("w2", (experts, d, width)))
    ]
    if cfg.n_shared_experts:
        s = cfg.shared_expert_ffn_dim // t
        out += [
            RankParameter(p + "moe.shared_experts.w1.weight", (s, d)),
            RankParameter(p + "moe.shared_experts.w3.weight", (s, d)),
            RankParameter(p + "moe.shared_experts.w2.weight", (d, s)),
        ]
        if cfg.shared_expert_gate:
            out.append(RankParameter(p + "moe.shared_gate.weight", (1, d)))
    return out


def rank_parameters(cfg: Config, pp_rank: int = 0) -> list[RankParameter]:
    """The parameters pipeline stage `pp_rank` holds, at their per-rank shapes (tp and ep applied)."""
    key = stage_key(cfg, pp_rank)  # the planner asks for the same stages many times
    return list(_STAGES.get(key, lambda: _stage_parameters(cfg.model, *key[1:])))


_MODEL_KEYS: Memo[str] = Memo(limit=256)


def model_key(m: ModelConfig) -> str:
    """The planner's cache key of a model config (unhashable, so its repr), formed once per object: the
    search asks for it a million times for the same few configs, which it never changes."""
    return _MODEL_KEYS.get(id(m), m.__repr__, keep=m)


def _split_key(cfg: Config) -> tuple:
    p = cfg.parallel
    return (
        model_key(cfg.model),
        cfg.training.seq_len,
        p.pp,
        p.vpp,
        p.pp_schedule,
        p.pp_embedding_layers,
        p.pp_head_layers,
        tuple(p.pp_layers),
        p.pp_balance,
    )


def layer_split(cfg: Config) -> list[list[int]]:
    """The layers of every chunk (schedules/balance.py), as the trainer runs them and the planner models
    them, cached per layout."""
    p, m = cfg.parallel, cfg.model

    def split() -> list[list[int]]:
        costs = layer_costs(m, cfg.training.seq_len) if p.pp_balance == "cost" else None
        return layer_split_of(cfg, costs)

    return _SPLITS.get(_split_key(cfg), split)


_SPLITS: Memo[list[list[int]]] = Memo()


def stage_key(cfg: Config, pp_rank: int) -> tuple:
    """What decides a stage's parameters: the model (by its repr: the model config is not hashable),
    the tp / ep cuts, and the layers, embedding and head the stage holds. The planner caches per-stage
    sums on it."""
    p = cfg.parallel

    def key() -> tuple:
        split, chunks = layer_split(cfg), chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
        layers = tuple(layer for c in chunks for layer in split[c])
        first, last = 0 in chunks, p.pp * p.vpp - 1 in chunks
        # The last stage's copy of the embedding: the tied head's, or the MTP depths' (pipeline/chunk.py).
        shares = cfg.model.tie_embeddings or cfg.model.mtp_depth > 0
        tied_copy = shares and last and not first
        return (model_key(cfg.model), p.tp, p.ep, p.etp, layers, first, last, tied_copy, pp_rank)

    return _STAGE_KEYS.get((_split_key(cfg), p.tp, p.ep, p.etp, pp_rank), key)


_STAGE_KEYS: Memo[tuple] = Memo()


def stage_signature(cfg: Config, pp_rank: int) -> tuple:
    """What makes two stages' parameters, memory and per-micro-batch costs equal: per chunk its dense
    and MoE layer counts, and whether it holds the embedding or the head (the middle stages of a deep
    pipeline share one, so the planner computes them once)."""
    p, m = cfg.parallel, cfg.model

    def signature() -> tuple:
        split, chunks = layer_split(cfg), chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
        moe = [sum(m.is_moe_layer(layer) for layer in split[c]) for c in chunks]
        kinds = tuple((len(split[c]) - n, n) for c, n in zip(chunks, moe, strict=True))
        return (kinds, 0 in chunks, p.pp * p.vpp - 1 in chunks)

    return _SIGNATURES.get((_split_key(cfg), pp_rank), signature)


_SIGNATURES: Memo[tuple] = Memo()
_STAGES: Memo[tuple[RankParameter, ...]] = Memo()


def _stage_parameters(
    m: ModelConfig,
    tp: int,
    ep: int,
    etp: int,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    tied_copy: bool,
    pp_rank: int,
) -> tuple[RankParameter, ...]:
    """rank_parameters' work, for the fields it reads."""
    vocab_rows = math.ceil(m.vocab_size / tp)
    out = []
    if first:
        out.append(RankParameter("tok_embeddings.weight", (vocab_rows, m.dim)))
    for layer in layers:
        out += _block_parameters(m, layer, tp, ep, etp in (0, tp))
    if last:
        out.append(RankParameter("norm.weight", (m.dim,)))
        if not m.tie_embeddings:
            out.append(RankParameter("output.weight", (vocab_rows, m.dim)))
        if tied_copy:  # the embedding's copy on the last stage (tied head, or MTP)
            out.append(RankParameter("tok_embeddings.weight", (vocab_rows, m.dim)))
        out += _mtp_parameters(m, tp, ep, etp)
    return tuple(out)


def _mtp_parameters(m: ModelConfig, tp: int, ep: int, etp: int) -> list[RankParameter]:
    """The multi-token prediction depths' parameters (models/mtp.py), on the last stage."""
    out = []
    for k in range(m.mtp_depth):
        p = f"mtp.{k}."
        out += [RankParameter(p + name, (m.dim,)) for name in ("enorm.weight", "hnorm.weight", "norm.weight")]
        out.append(RankParameter(p + "eh_proj.weight", (m.dim, 2 * m.dim)))
        block = _block_parameters(m, m.n_layers + k, tp, ep, etp in (0, tp))
        out += [
            dataclasses.replace(x, name=x.name.replace(f"layers.{m.n_layers + k}.", p + "block."))
            for x in block
        ]
    return out


@lru_cache(maxsize=65536)  # (the search asks for the same few shapes millions of times)
def row_block_elements(shape: tuple[int, ...], n: int, padded: bool, cut_within: bool = True) -> int:
    """Elements of rank 0's row block of `shape` over n ranks (config/row_blocks.py; padded: its full
    block, padding rows included)."""
    rows_shape, rows = row_shape(shape, n, cut_within), block_rows(shape, n, cut_within)
    return (rows if padded else min(rows, rows_shape[0])) * math.prod(rows_shape[1:])


def engine_state_bytes(
    shapes: list[tuple[int, ...]],
    shard: int,
    zero: int,
    mixed: bool = False,
    muon: list[bool] | None = None,
    cut_within: bool = True,
    outer: int = 0,
) -> dict[str, int]:
    """Rank 0's bytes of parameters, gradients and optimizer state under the engine of a group of `shard`.
    `mixed` (bf16 training): engines with whole parameters hold them in bf16 besides fp32 masters (the
    owned rows under ZeRO-1/2, counted with the parameters); ZeRO-3's parameters are its fp32 shards
    either way (their bf16 units are gathered per use: gpu_memory.py's buffers). `muon[i]`: shape i is a
    Muon matrix, whose state is one fp32 momentum per element (AdamW's: two moments). `cut_within`: how
    the engines cut stacks of matrices (config/row_blocks.py; not under Muon). `outer`: bytes per owned
    element of DiLoCo's outer weights and momentum (train/diloco.py: 8 in fp32), counted as optimizer
    state."""
    full = sum(math.prod(s) for s in shapes)
    padded = sum(row_block_elements(s, shard, True, cut_within) for s in shapes)
    state_of = [(4 if m else 8) + outer for m in (muon or [False] * len(shapes))]
    if shard == 1:
        optimizer = sum(b * math.prod(s) for b, s in zip(state_of, shapes, strict=True))
        return {"params": (6 if mixed else 4) * full, "grads": 4 * full, "optimizer": optimizer}
    if zero == 3:
        optimizer = sum(
            b * row_block_elements(s, shard, True, cut_within) for b, s in zip(state_of, shapes, strict=True)
        )
        return {"params": 4 * padded, "grads": 4 * padded, "optimizer": optimizer}
    params = 2 * full + 4 * padded if mixed else 4 * full
    optimizer = sum(
        b * row_block_elements(s, shard, False, cut_within) for b, s in zip(state_of, shapes, strict=True)
    )
    return {"params": params, "grads": 4 * (full if zero == 1 else padded), "optimizer": optimizer}


def state_bytes(cfg: Config, world_size: int, pp_rank: int = 0) -> dict[str, int]:
    """Rank 0 of pipeline stage `pp_rank`: bytes of parameters, gradients and optimizer state."""
    p = cfg.parallel
    dp_shard = p.dp_shard_for(world_size)
    shard = dp_shard * p.cp
    mixed = cfg.training.dtype != "fp32"

    muon = cfg.training.optimizer == "muon"
    outer = 8 if cfg.fault_tolerance.diloco_every else 0  # DiLoCo's θ_outer and momentum, fp32

    def engine(params: list[RankParameter], n: int) -> dict[str, int]:
        marks = [muon and is_muon_matrix(x.name, len(x.shape)) for x in params]
        return engine_state_bytes([x.shape for x in params], n, p.zero, mixed, marks, not muon, outer)

    def held() -> dict[str, int]:
        params = rank_parameters(cfg, pp_rank)
        dense = engine([x for x in params if not x.expert or not p.experts_apart], shard)
        if p.experts_apart:
            experts = engine([x for x in params if x.expert], p.edp_of(shard))
            dense = {k: dense[k] + experts[k] for k in dense}
        return dense

    return dict(_STATES.get((stage_key(cfg, pp_rank), shard, p.zero, mixed, muon, outer), held))


_STATES: Memo[dict[str, int]] = Memo()


def saved_bytes(cfg: Config, world_size: int, pp_rank: int = 0) -> int:
    """What rank 0 of stage `pp_rank` saves in a checkpoint (or sends a healing peer): the fp32 weights of
    the rows it owns, without padding, and their optimizer state (AdamW's two moments, Muon's momentum
    for its matrices), and DiLoCo's outer weights and momentum when it runs."""
    p = cfg.parallel
    shard = p.dp_shard_for(world_size) * p.cp
    muon, cut = cfg.training.optimizer == "muon", cfg.training.optimizer != "muon"
    outer = 8 if cfg.fault_tolerance.diloco_every else 0
    total = 0
    for x in rank_parameters(cfg, pp_rank):
        n = p.edp_of(shard) if x.expert and p.experts_apart else shard
        owned = math.prod(x.shape) if n == 1 else row_block_elements(x.shape, n, False, cut)
        moments = 4 if muon and is_muon_matrix(x.name, len(x.shape)) else 8
        total += (4 + moments + outer) * owned
    return total


def expert_state_bytes(cfg: Config, pp_rank: int = 0) -> int:
    """Bytes of the routed experts' parameters, gradients and optimizer state on a rank of stage
    `pp_rank` (0 when the experts are sharded like the dense weights: they are part of those)."""
    p = cfg.parallel
    params = [x.shape for x in rank_parameters(cfg, pp_rank) if x.expert]
    if not params:
        return 0
    edp = p.edp_of(p.dp_shard * p.cp) if p.experts_apart else p.dp_shard * p.cp
    muon = [cfg.training.optimizer == "muon"] * len(params)  # every routed expert's matrix is Muon's
    mixed = cfg.training.dtype != "fp32"
    outer = 8 if cfg.fault_tolerance.diloco_every else 0
    return sum(engine_state_bytes(params, edp, p.zero, mixed, muon, not any(muon), outer).values())
