"""Bytes one GPU holds at the peak of a step, for one pipeline stage, by part.

  part          bytes
  params        plan/state.py: fp32 masters (a ZeRO-3 shard, or whole); with bf16, engines that keep
                whole parameters hold them once in bf16 (every micro-batch shares that copy) besides
                the fp32 masters (ZeRO-1/2: the owned rows; engines/mixed_precision.py)
  grads         plan/state.py: fp32 gradients (bucket buffers, a ZeRO-2/3 shard)
  optimizer     plan/state.py: AdamW's fp32 m and v of the owned rows
  activations   the most the stage's pipeline schedule keeps at once, walked action by action: each
                forward keeps its chunk's layers (plan/memory.py, per layer kind and recompute mode) and
                the head's log-probabilities on the last chunk until its backward; with a split backward
                the linear layers' inputs and output gradients stay until the weight-gradient pass
                (the search's screen multiplies the largest chunk by a closed-form count instead)
  transient     what a step holds for a moment beyond the parts above, the larger of: on the stage with
                the head, the loss's working set for one micro-batch (its gradients of the
                log-probabilities and of the logits); under full recompute, a layer's activations while
                its backward reruns its forward; after backward, with the activations gone, foreach
                AdamW's temporary (one fp32 value per owned element) less the activations it replaces
  buffers       the data-parallel engine's communication buffers (plan/buffers.py): ZeRO-1/2's staging,
                received and packed shards; ZeRO-3's gathered blocks, reduce-scatter inputs and root
  reserved      the CUDA context, library workspaces and the caching allocator's fragmentation:
                `MemoryOverhead` (calibrated, docs/planner.md)

The most loaded rank is the largest total over the stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from meshtron.config.schema import SPLIT_BACKWARD, Config, ModelConfig
from meshtron.plan.buffers import engine_buffers
from meshtron.plan.memory import head_activation_bytes, layer_activation_bytes
from meshtron.plan.network import ep_group
from meshtron.plan.state import layer_split, model_key, state_bytes
from meshtron.rules.data import micro_batches_per_step
from meshtron.schedules.actions import Kind, chunks_of_rank
from meshtron.schedules.build import compute_orders
from meshtron.utils.memo import Memo

GiB = 2**30


@dataclass(frozen=True)
class MemoryOverhead:
    """What the planner adds beyond the tensors it counts."""

    context_bytes: float = 2.0 * GiB  # CUDA context, cuBLAS / NCCL workspaces
    fragmentation: float = 0.05  # of the counted bytes, the allocator's unusable gaps
    in_place_reduce: bool = False  # gloo: ZeRO-1 all-reduces whole buckets in place (plan/buffers.py)


_SUMS: Memo[int] = Memo(limit=8192)  # per-stage sums the search asks for again and again


def _cached(key: tuple, compute: Callable[[], int]) -> int:
    """A per-stage sum, keyed on plan/state.py's stage_key."""
    return _SUMS.get(key, compute)


def layer_bytes(cfg: Config, layer: int, recompute: str) -> int:
    """Bytes layer `layer` keeps for one micro-batch (plan/memory.py; MoE layers at balanced routing)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    kwargs = dict(tp=p.tp, sp=p.sp, recompute=recompute, cp=p.cp, exchange=p.cp_exchange)
    if recompute == "op":
        kwargs["op_saves"] = t.op_recompute_saves
    if p.cp_impl == "alltoall":
        kwargs["ulysses"] = p.cp
    if m.is_moe_layer(layer):
        kwargs.update(ep=p.ep, ep_dispatch=p.ep_dispatch, expert_tp=p.expert_tp)
        if recompute == "op":
            kwargs["op_keeps_dispatch"] = t.op_recompute_dispatch == "keep"
            if p.ep_dispatch == "hierarchical" and cfg.run.gpus_per_node:  # (unset: one node)
                kwargs["ep_per_node"] = ep_group(p.ep, p.tp, p.expert_tp, cfg.run.gpus_per_node).per_node
    act = 2 if t.dtype != "fp32" else 4
    key = ("layer", model_key(m), m.is_moe_layer(layer), t.micro_batch, t.seq_len, act, tuple(kwargs.items()))
    return _cached(key, lambda: layer_activation_bytes(m, t.micro_batch, t.seq_len, act, layer, **kwargs))


def _kinds(m: ModelConfig, layers: list[int]) -> list[tuple[int, int]]:
    """(a layer, how many) per kind of layer among `layers`: a layer's bytes depend only on whether it
    is an MoE layer."""
    if not m.is_moe:
        return [(layers[0], len(layers))] if layers else []
    return _KINDS.get((model_key(m), tuple(layers)), lambda: _kinds_of(m, layers))


_KINDS: Memo[list[tuple[int, int]]] = Memo(limit=4096)  # per model and chunk's layers


def _kinds_of(m: ModelConfig, layers: list[int]) -> list[tuple[int, int]]:
    moe = [layer for layer in layers if m.is_moe_layer(layer)]
    dense = [layer for layer in layers if not m.is_moe_layer(layer)]
    return [(group[0], len(group)) for group in (dense, moe) if group]


def chunk_activation_bytes(cfg: Config, pp_rank: int, layers: list[int], last: bool) -> float:
    """Bytes one micro-batch keeps in one chunk of stage `pp_rank` until its backward."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    total = 0.0
    for layer, count in _kinds(m, layers):
        total += count * layer_bytes(cfg, layer, t.recompute)
    if last:
        head = head_activation_bytes(m, t.micro_batch, t.seq_len, tp=p.tp, sp=p.sp, cp=p.cp, dtype=t.dtype)
        total += head + m.mtp_depth * (head + _mtp_depth_bytes(cfg))
    return total


def _mtp_depth_bytes(cfg: Config) -> float:
    """One multi-token prediction depth's block, and around it (models/mtp.py) its two input norms
    (input, 1/rms, normalised: 2·h + 1 each) and its projection's input [embedding; h] (2·h)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tokens = t.micro_batch * t.seq_len // p.cp // (p.tp if p.sp else 1)
    act = 2 if t.dtype != "fp32" else 4
    return layer_bytes(cfg, m.n_layers, t.recompute) + tokens * (6 * m.dim + 2) * act


def loss_transient_bytes(cfg: Config) -> float:
    """What the loss holds for a moment beyond what it keeps, for one micro-batch on the stage with the
    head: the gradients of the log-probabilities and of the logits while the kept log-probabilities are
    there (under tp, the shifted logits and their exponentials in forward): about 3 fp32 values per token
    and vocabulary entry of this rank."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    return 3 * 4 * (t.micro_batch * t.seq_len // p.cp) * math.ceil(m.vocab_size / p.tp)


def recompute_transient_bytes(cfg: Config, layers: list[int]) -> float:
    """Under full (or per-operation) recompute, a layer's backward first runs its forward again: for a
    moment the layer holds what it keeps without recompute (the largest of the stage's layers). What op
    recompute keeps of the expert dispatch is not among that, and stays alive beside it."""
    t = cfg.training
    if t.recompute not in ("full", "op") or not layers:
        return 0.0
    keeps = t.recompute == "op" and t.op_recompute_dispatch != "rerun"  # (only "op" reads the setting)
    rebuilt = replace(cfg, training=replace(t, op_recompute_dispatch="rerun")) if keeps else cfg
    return max(
        layer_bytes(cfg, layer, "none") - layer_bytes(rebuilt, layer, t.recompute)
        for layer, _ in _kinds(cfg.model, layers)
    )


def optimizer_transient_bytes(optimizer_bytes: float) -> float:
    """foreach AdamW's temporary: the square root of the second moment of a whole parameter group at once,
    one fp32 value per owned element (m and v hold two): half the optimizer state (the 1-D group, norms,
    is a rounding error next to the matrices')."""
    return optimizer_bytes / 2


def _attention_weight_inputs(m: ModelConfig, tp: int, sp: bool) -> float:
    """Values per token that one attention block leaves waiting for W: the distinct inputs of its
    linear layers and every layer's output gradient. Grouped-query: the normed input (shared by q, k,
    v), the attention output; q, k, v and wo's outputs. Latent (MLA): the input, the two normed latents,
    the attention output; the down-projections', up-projections' and wo's outputs. Under sp with
    q_lora_rank the down-projections see this rank's 1/tp of the tokens (parallel/tensor.py)."""
    if not m.is_mla:
        q, kv = m.n_heads * m.head_size // tp, m.kv_heads_per_rank(tp) * m.head_size
        return (m.dim + q) + (q + 2 * kv + m.dim)
    heads, shard = m.n_heads // tp, 1 / tp if sp and m.q_lora_rank else 1
    q_path = shard * (m.dim + m.q_lora_rank) + m.q_lora_rank if m.q_lora_rank else m.dim
    queries = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    latent = shard * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv_up, out = heads * (m.qk_nope_head_dim + m.v_head_dim), heads * m.v_head_dim
    return q_path + queries + latent + kv_up + out + m.dim


def _ffn_weight_inputs(m: ModelConfig, layer: int, tp: int) -> float:
    """...and one feed-forward: SwiGLU's input, hidden and its three outputs; an MoE layer's router (the
    experts' grouped GEMMs are not linear layers: B computes their weight gradients) and its shared
    experts, which read the router's input, and their gate."""
    if not m.is_moe_layer(layer):
        ffn = m.ffn_dim // tp
        return (m.dim + ffn) + (2 * ffn + m.dim)
    shared = m.shared_expert_ffn_dim // tp
    gate = 1 if m.shared_expert_gate else 0  # its one output per token (its input is the router's)
    shared_values = 3 * shared + m.dim + gate if m.n_shared_experts else 0
    return m.dim + m.n_experts + shared_values


def waiting_weight_grad_bytes(cfg: Config, layers: list[int], last: bool) -> float:
    """Split-backward schedules (pipeline/zero_bubble.py): what one micro-batch of a chunk keeps between
    its B and its W, every linear layer's input and output gradient (the rest of its activations are
    freed by B; tests/test_zero_bubble.py measures them)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tokens, act = t.micro_batch * t.seq_len // p.cp, 2 if t.dtype != "fp32" else 4
    attention = _attention_weight_inputs(m, p.tp, p.sp)
    values = sum(attention + _ffn_weight_inputs(m, layer, p.tp) for layer in layers)
    if last:  # the head's input and logits' gradient; each MTP depth's projection, block and head
        head = m.dim + math.ceil(m.vocab_size / p.tp)
        projection = 3 * m.dim / (p.tp if p.sp else 1)  # [embedding; h] in, h out, on the token shards
        depths = range(m.n_layers, m.n_layers + m.mtp_depth)
        values += head + sum(head + projection + attention + _ffn_weight_inputs(m, k, p.tp) for k in depths)
    return tokens * act * values


def walked_micro_batches(micro: int, pp: int, vpp: int, schedule: str) -> int:
    """How many micro-batches the memory walk needs to see a schedule's peak: every schedule but GPipe
    holds at most a bounded number in flight once its warm-up is over (1F1B pp, interleaved and the V
    schedules a few pp·vpp), so beyond 4·pp·vpp more micro-batches only repeat the steady state
    (tests/test_memory_model.py checks the peak is the same for every family); GPipe holds them all."""
    cap = 4 * pp * vpp
    return micro if schedule == "gpipe" or micro <= cap else cap


@lru_cache(maxsize=64)
def _orders(pp: int, vpp: int, micro: int, schedule: str) -> list[list[tuple[Kind, int, int]]]:
    """Every rank's compute steps (built once per schedule, not once per stage asked about)."""
    return compute_orders(pp, vpp, micro, schedule)


def schedule_activation_bytes(cfg: Config, pp_rank: int, split: list[list[int]]) -> float:
    """The most activation bytes stage `pp_rank` holds at once, walking its action list: a forward (F)
    keeps its chunk's activations until the input-gradient backward (B); with a split backward, B leaves
    the linear layers' inputs and output gradients until the weight-gradient pass (W). Chunk 0 never
    waits: nothing needs its input gradient, so its B computes the weight gradients at once."""
    p, t = cfg.parallel, cfg.training
    m = walked_micro_batches(
        micro_batches_per_step(t.global_batch, t.micro_batch, p.dp_replicate * p.dp_shard),
        p.pp,
        p.vpp,
        p.pp_schedule,
    )
    last, splits = p.pp * p.vpp - 1, p.pp_schedule in SPLIT_BACKWARD
    chunks = chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
    kept = {c: chunk_activation_bytes(cfg, pp_rank, split[c], c == last) for c in chunks}
    waiting = {
        c: waiting_weight_grad_bytes(cfg, split[c], c == last) if splits and c > 0 else 0 for c in chunks
    }

    def walk() -> float:
        return peak_of(_alive_counts(p.pp, p.vpp, m, p.pp_schedule, pp_rank), kept, waiting)

    key = ("walk", p.pp, p.vpp, m, p.pp_schedule, pp_rank, tuple(kept.items()), tuple(waiting.items()))
    return _cached(key, walk)


@dataclass(frozen=True)
class AliveStates:
    """What one rank's actions can hold at their peak: its `chunks`, and `states`, each the micro-batches
    per chunk (in that order) whose F ran and B did not, then those whose B ran and W did not."""

    chunks: tuple[int, ...]
    states: frozenset[tuple[int, ...]]


@lru_cache(maxsize=8192)  # (a search of 256 ranks asks for thousands of stages' schedules)
def _alive_counts(pp: int, vpp: int, micro: int, schedule: str, rank: int) -> AliveStates:
    """alive_counts of one rank's actions, once per schedule (the search asks for thousands of layouts)."""
    return alive_counts(_orders(pp, vpp, micro, schedule)[rank])


def alive_counts(steps: list[tuple[Kind, int, int]]) -> AliveStates:
    """The states along one rank's compute steps (kind, chunk, micro-batch) that can hold its peak: after
    each step, per chunk, the micro-batches whose F ran and B did not (they hold the chunk's kept
    activations) and those whose B ran and W did not (they hold its waiting weight-gradient inputs); of
    those, the ones no other state holds as many of every count as (bytes are never negative). A steady
    state repeats a few of them."""
    chunks = tuple(sorted({chunk for _, chunk, _ in steps}))
    index = {c: i for i, c in enumerate(chunks)}
    split = any(kind == Kind.W for kind, _, _ in steps)  # (without W passes nothing waits after B)
    counts, states = [0] * (2 * len(chunks)), set()
    for kind, chunk, _ in steps:
        if kind == Kind.F:
            counts[index[chunk]] += 1
        elif kind == Kind.B:
            counts[index[chunk]] -= 1
            counts[len(chunks) + index[chunk]] += split
        elif kind == Kind.W:
            counts[len(chunks) + index[chunk]] -= 1
        states.add(tuple(counts))
    top: list[tuple[int, ...]] = []  # a dominating state has the larger sum: meet those first
    for state in sorted(states, key=sum, reverse=True):
        if not any(all(x <= y for x, y in zip(state, o, strict=True)) for o in top):
            top.append(state)
    return AliveStates(chunks, frozenset(top))


def peak_of(alive: AliveStates, kept: dict[int, float], waiting: dict[int, float]) -> float:
    """The most bytes alive in any of `alive`'s states: each held micro-batch of a chunk keeps its `kept`
    bytes, each waiting one its `waiting` bytes."""
    weights = [kept[c] for c in alive.chunks] + [waiting[c] for c in alive.chunks]
    peaks = (sum(n * w for n, w in zip(state, weights, strict=True)) for state in alive.states)
    return max(0.0, max(peaks, default=0.0))


@dataclass(frozen=True)
class StageBase:
    """What a stage's rank holds whatever its micro-batches in flight: parameters, gradients and
    optimizer state, the engines' buffers, its largest chunk's activations for one micro-batch, and
    the backward's transient (the loss's, or a fully recomputed layer's)."""

    state: dict[str, float]
    largest: float
    backward: float
    buffers: float


def stage_base(cfg: Config, world_size: int, pp_rank: int, overhead: MemoryOverhead) -> StageBase:
    p = cfg.parallel
    split = layer_split(cfg)
    chunks = chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
    last_chunk = p.pp * p.vpp - 1
    largest = max(chunk_activation_bytes(cfg, pp_rank, split[c], c == last_chunk) for c in chunks)
    loss = loss_transient_bytes(cfg) if last_chunk in chunks else 0.0
    backward = max(loss, recompute_transient_bytes(cfg, [layer for c in chunks for layer in split[c]]))
    buffers = engine_buffers(cfg, world_size, pp_rank, overhead.in_place_reduce)
    return StageBase(dict(state_bytes(cfg, world_size, pp_rank)), largest, backward, buffers)


def stage_total(base: StageBase, activations: float, overhead: MemoryOverhead) -> dict[str, float]:
    """A stage's bytes by part (the module docstring's table) holding `activations`."""
    out: dict[str, float] = dict(base.state)
    out["activations"] = activations
    # The optimizer's temporary comes after the activations are gone: it adds only where it is larger.
    out["transient"] = max(base.backward, optimizer_transient_bytes(out["optimizer"]) - activations)
    out["buffers"] = base.buffers
    counted = sum(out.values())
    out["reserved"] = overhead.context_bytes + overhead.fragmentation * counted
    return out


def stage_memory(
    cfg: Config, world_size: int, pp_rank: int, in_flight: int | None, overhead: MemoryOverhead
) -> dict[str, float]:
    """Bytes of stage `pp_rank`'s rank 0 at its peak, by part (the module docstring's table), with
    `in_flight` of its largest chunk's micro-batches kept at once (a bound: the search's screen), or
    None: the activations its pipeline schedule holds at most (walked action by action)."""
    base = stage_base(cfg, world_size, pp_rank, overhead)
    if in_flight is None and cfg.parallel.pp > 1:
        return stage_total(base, schedule_activation_bytes(cfg, pp_rank, layer_split(cfg)), overhead)
    return stage_total(base, (in_flight or 1) * base.largest, overhead)


def start_up_memory(cfg: Config, world_size: int, pp_rank: int, overhead: MemoryOverhead) -> dict[str, float]:
    """Bytes of stage `pp_rank`'s rank 0 once set up, before step 1: its parameters, and the gradient
    buffers that DDP and ZeRO-1/2 fill with zeros when they are built (ZeRO-3's gradient shard and
    fully_shard's gradients become resident in the first backward: engines/materialize.py's
    `untouched_zeros`), and the context. AdamW's state, the activations and the engines' communication
    buffers come with step 1."""
    state, p = state_bytes(cfg, world_size, pp_rank), cfg.parallel
    sharded = p.zero == 3 and p.dp_shard_for(world_size) * p.cp > 1 and p.fsdp_impl != "simple"
    out = {"params": float(state["params"]), "grads": 0.0 if sharded else float(state["grads"])}
    out["reserved"] = overhead.context_bytes
    return out
