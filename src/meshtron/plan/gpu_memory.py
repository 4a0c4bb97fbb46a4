"""Bytes one GPU holds at the peak of a step, for one pipeline stage, by part.

  part          bytes
  params        plan/state.py: fp32 masters (a ZeRO-3 shard, or whole); with bf16, engines that keep
                whole parameters hold them once in bf16 (every micro-batch shares that copy) besides
                the fp32 masters (ZeRO-1/2: the owned rows; parallel/mixed_precision.py)
  grads         plan/state.py: fp32 gradients (bucket buffers, a ZeRO-2/3 shard)
  optimizer     plan/state.py: AdamW's fp32 m and v of the owned rows
  activations   the most micro-batches the schedule keeps in flight on the stage (the simulator's
                `peak_in_flight`, counted in chunks: interleaving's extra factor comes from there), each
                holding its chunk's layers (plan/memory.py, per layer kind and recompute mode) and the
                head's logits on the last chunk (the weights it reads are the parameters themselves)
  buffers       ZeRO-3: the gathered layer and the next one (prefetch) in the compute dtype, and one
                layer's unsharded fp32 gradient before its reduce-scatter
  reserved      the CUDA context, library workspaces and the caching allocator's fragmentation:
                `MemoryOverhead` (calibrated, docs/planner.md)

The most loaded rank is the largest total over the stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from meshtron.config import Config
from meshtron.pipeline.actions import chunks_of_rank
from meshtron.plan.memory import head_activation_bytes, layer_activation_bytes
from meshtron.plan.state import layer_split, rank_parameters, stage_key, state_bytes

GiB = 2**30


@dataclass(frozen=True)
class MemoryOverhead:
    """What the planner adds beyond the tensors it counts."""

    context_bytes: float = 2.0 * GiB  # CUDA context, cuBLAS / NCCL workspaces
    fragmentation: float = 0.05  # of the counted bytes, the allocator's unusable gaps


_SUMS: dict[tuple, int] = {}


def _cached(key: tuple, compute: Callable[[], int]) -> int:
    """Per-stage sums the search asks for again and again (keyed on plan/state.py's stage_key)."""
    if key not in _SUMS:
        if len(_SUMS) > 8192:
            _SUMS.clear()
        _SUMS[key] = compute()
    return _SUMS[key]


def layer_bytes(cfg: Config, layer: int, recompute: str) -> int:
    """Bytes layer `layer` keeps for one micro-batch (plan/memory.py; MoE layers at balanced routing)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    kwargs = dict(tp=p.tp, sp=p.sp, recompute=recompute, cp=p.cp)
    if p.cp_impl == "alltoall":
        kwargs["ulysses"] = p.cp
    if m.is_moe_layer(layer):
        kwargs.update(ep=p.ep, ep_dispatch=p.ep_dispatch, expert_tp=p.expert_tp)
    act = 2 if t.dtype == "bf16" else 4
    key = ("layer", repr(m), m.is_moe_layer(layer), t.micro_batch, t.seq_len, act, tuple(kwargs.items()))
    return _cached(key, lambda: layer_activation_bytes(m, t.micro_batch, t.seq_len, act, layer, **kwargs))


def chunk_activation_bytes(cfg: Config, pp_rank: int, layers: list[int], last: bool) -> float:
    """Bytes one micro-batch keeps in one chunk of stage `pp_rank` until its backward."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    total = 0.0
    for layer in layers:
        total += layer_bytes(cfg, layer, t.recompute)
    if last:
        total += head_activation_bytes(m, t.micro_batch, t.seq_len, tp=p.tp, sp=p.sp, cp=p.cp, dtype=t.dtype)
    return total


def _zero3_buffers(cfg: Config, pp_rank: int) -> float:
    """The gathered current and next layer in the compute dtype and one layer's fp32 gradient."""
    p, t = cfg.parallel, cfg.training
    if p.zero != 3 or p.dp_shard * p.cp == 1:
        return 0.0

    def largest_unit() -> int:
        sizes: dict[str, int] = {}
        for x in rank_parameters(cfg, pp_rank):
            unit = ".".join(x.name.split(".")[:2]) if x.name.startswith("layers.") else x.name
            sizes[unit] = sizes.get(unit, 0) + math.prod(x.shape)
        return max(sizes.values(), default=0)

    largest = _cached(("unit", stage_key(cfg, pp_rank)), largest_unit)
    return largest * (2 * (2 if t.dtype == "bf16" else 4) + 4)


def stage_memory(
    cfg: Config, world_size: int, pp_rank: int, in_flight: int, overhead: MemoryOverhead
) -> dict[str, float]:
    """Bytes of stage `pp_rank`'s rank 0 at its peak, by part (the module docstring's table), with
    `in_flight` chunk-micro-batches kept at once (the simulator's peak for the rank)."""
    p = cfg.parallel
    split = layer_split(cfg)
    chunks = chunks_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
    last_chunk = p.pp * p.vpp - 1
    largest = max(chunk_activation_bytes(cfg, pp_rank, split[c], c == last_chunk) for c in chunks)
    out: dict[str, float] = dict(state_bytes(cfg, world_size, pp_rank))
    out["activations"] = in_flight * largest
    out["buffers"] = _zero3_buffers(cfg, pp_rank)
    counted = sum(out.values())
    out["reserved"] = overhead.context_bytes + overhead.fragmentation * counted
    return out
