"""The communication buffers a data-parallel engine keeps, from the shapes of a stage's parameters.

A unit is what one forward reads at once: each transformer block, and the root (everything outside the
blocks: embedding, final norm, head). A bucket is about `parallel.bucket_mb` of gradients, in the order
backward produces them. n is the shard group's size, pb the compute dtype's bytes, rb the reduce
dtype's; a unit's "full" size is its padded rows over all n ranks, its "shard" 1/n of that.

  engine      buffer                                                      bytes
  ZeRO-1/2    two staging buffers per dtype, of the largest bucket or unit  2 · max(full) · dtype
              (the reduce-scatter's packed input; the gather's output)      (one pool when pb = rb)
              each bucket's received shard (not when gloo all-reduces       Σ bucket shard · rb
              stage 1's whole buckets in place)
              each unit's shard, packed for its gather                      Σ unit shard · pb
  ZeRO-3      two gathered blocks (the running one and the prefetch)        2 · block full · pb
              two reduce-scatter inputs with their received shard           2 · (block full + shard) · rb
              the root, gathered whole for all of forward and again for     root full · pb
              the head's backward (its gathers get buffers of their own)

engines/zero.py, engines/fsdp.py and engines/staging.py allocate these;
benchmarks/memory_vs_plan.py measures them with the rest of a rank's peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from meshtron.config.row_blocks import padded_numel
from meshtron.config.schema import Config
from meshtron.plan.state import RankParameter, rank_parameters, stage_key
from meshtron.utils.memo import Memo


def _units(params: Iterable[RankParameter]) -> dict[str, list[RankParameter]]:
    """The root ("root": what lies outside the blocks) and each block, as the engines group them. The root
    comes first on the stage with the embedding, last on a later one (norm and head)."""
    units: dict[str, list[RankParameter]] = {}
    for x in params:
        key = ".".join(x.name.split(".")[:2]) if x.name.startswith("layers.") else "root"
        units.setdefault(key, []).append(x)
    return units


def _buckets(params: list[RankParameter], bucket_bytes: int) -> list[list[RankParameter]]:
    """Greedy groups of about bucket_bytes of fp32 gradient, last parameter first (ddp.make_buckets)."""
    buckets: list[list[RankParameter]] = [[]]
    size = 0
    for x in reversed(params):
        nbytes = 4 * math.prod(x.shape)
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(x)
        size += nbytes
    return buckets


def zero12_buffers(cfg: Config, params: list[RankParameter], n: int, in_place: bool) -> float:
    """ZeRO-1/2's buffers for `params` sharded over n ranks (the table above)."""
    if n == 1 or not params:
        return 0.0
    p, t = cfg.parallel, cfg.training
    pb, rb = (2 if t.dtype != "fp32" else 4), (2 if p.reduce_dtype == "bf16" else 4)
    cut = t.optimizer != "muon"  # config/row_blocks.py
    buckets = [
        sum(padded_numel(x.shape, n, cut) for x in b) for b in _buckets(params, int(p.bucket_mb * 2**20))
    ]
    units = [sum(padded_numel(x.shape, n, cut) for x in u) for u in _units(params).values()]
    packs = not (in_place and p.zero == 1 and p.dp_replicate == 1)  # gloo all-reduces stage 1 in place
    staging = {rb: max(buckets) if packs else 0}
    staging[pb] = max(staging.get(pb, 0), max(units))
    held = sum(2 * numel * nbytes for nbytes, numel in staging.items())
    received = sum(buckets) // n * rb if packs else 0
    return held + received + sum(units) // n * pb


def zero3_buffers(cfg: Config, params: list[RankParameter], n: int) -> float:
    """ZeRO-3's buffers for `params` sharded over n ranks (the table above)."""
    if n == 1 or not params:
        return 0.0
    p, t = cfg.parallel, cfg.training
    pb, rb = (2 if t.dtype != "fp32" else 4), (2 if p.reduce_dtype == "bf16" else 4)
    cut = t.optimizer != "muon"  # config/row_blocks.py
    sizes = {key: sum(padded_numel(x.shape, n, cut) for x in unit) for key, unit in _units(params).items()}
    root = sizes.pop("root", 0)
    block = max(sizes.values(), default=0)
    return 2 * block * pb + 2 * (block + block // n) * rb + root * pb


def engine_buffers(cfg: Config, world_size: int, pp_rank: int, in_place: bool) -> float:
    """The buffers of stage `pp_rank`'s engines: the dense parameters' over dp_shard·cp, the experts'
    over edp (a separate engine under ep > 1). `in_place`: the backend's reduce-scatter is an
    all-reduce (gloo), which ZeRO-1 runs on its whole buckets."""
    p, t = cfg.parallel, cfg.training
    shard = p.dp_shard_for(world_size) * p.cp
    key = (
        stage_key(cfg, pp_rank),
        shard,
        p.zero,
        p.dp_replicate,
        p.bucket_mb,
        t.dtype,
        p.reduce_dtype,
        in_place,
    )
    # The same for every micro-batch size and recompute mode the search tries.
    return _BUFFERS.get(key, lambda: _engine_buffers(cfg, shard, pp_rank, in_place))


_BUFFERS: Memo[float] = Memo()


def _engine_buffers(cfg: Config, shard: int, pp_rank: int, in_place: bool) -> float:
    p = cfg.parallel
    params = rank_parameters(cfg, pp_rank)
    groups = [([x for x in params if not x.expert or not p.experts_apart], shard)]
    if p.experts_apart:
        groups.append(([x for x in params if x.expert], p.edp_of(shard)))
    if p.zero == 3:
        return sum(zero3_buffers(cfg, group, n) for group, n in groups)
    return sum(zero12_buffers(cfg, group, n, in_place) for group, n in groups)
