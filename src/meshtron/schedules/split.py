"""Which transformer layers each pipeline chunk holds.

The model is cut into pp·vpp chunks (which rank holds which: schedules.chunks_of_rank). The embedding sits on the
first chunk and the final norm, output head and loss on the last. An even split can count the embedding
and the head+loss as `embedding_weight` and `head_weight` layers' worth of work, so the first and last
chunks get fewer transformer layers; or the caller gives the layer count of every chunk explicitly.

Every middle chunk holds at least one layer. The first chunk may hold none (the embedding alone) and so
may the last (the final norm, head and loss alone): Megatron-Core's layouts that count the embedding and
the loss as a layer each (`--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-
split`) give them chunks of their own, e.g. Qwen3-235B's 94 layers over pp 32 x vpp 3 = 96 chunks. A
balanced split leaves an edge chunk empty only when the layers cannot fill every chunk and that edge
weighs a layer or more.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def split_problems(
    n_layers: int,
    chunks: int,
    explicit: Sequence[int] = (),
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
) -> list[str]:
    """Why the layers cannot be split into `chunks` (pp·vpp) chunks this way, with the fix."""
    problems = []
    if explicit:
        middle_empty = any(n < 1 for n in explicit[1:-1])
        if len(explicit) != chunks or middle_empty or min(explicit) < 0 or sum(explicit) != n_layers:
            problems.append(
                f"parallel.pp_layers={list(explicit)} must give pp*vpp={chunks} layer counts adding up to "
                f"model.n_layers={n_layers}, each positive (the first and last may be 0: the embedding "
                "or the head alone)"
            )
        if embedding_weight or head_weight:
            problems.append(
                "parallel.pp_layers gives the split explicitly; parallel.pp_embedding_layers and "
                "parallel.pp_head_layers only weigh a balanced split: set one or the other"
            )
    elif n_layers < chunks - len(_emptiable(chunks, embedding_weight, head_weight)):
        most = n_layers + len(_emptiable(chunks, embedding_weight, head_weight))
        hint = (
            " (or weigh the embedding and the head as a layer each, parallel.pp_embedding_layers=1 and "
            "pp_head_layers=1: they then take chunks of their own)"
            if most < n_layers + 2 and chunks <= n_layers + 2
            else ""
        )
        problems.append(
            f"model.n_layers={n_layers} cannot fill pp*vpp={chunks} pipeline chunks; use pp*vpp <= {most}{hint}"
        )
    return problems


def _emptiable(chunks: int, embedding_weight: float, head_weight: float) -> set[int]:
    """The edge chunks a balanced split may leave without layers: those weighing a layer or more."""
    if chunks < 2:
        return set()
    return {i for i, w in ((0, embedding_weight), (chunks - 1, head_weight)) if w >= 1}


def split_layers(
    n_layers: int,
    chunks: int,
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
    explicit: Sequence[int] | None = None,
) -> list[list[int]]:
    """Layer indices of every chunk, in order; every middle chunk gets at least one layer."""
    if chunks < 1:
        raise ValueError(f"the number of pipeline chunks must be positive, got {chunks}")
    problems = split_problems(n_layers, chunks, explicit or (), embedding_weight, head_weight)
    if problems:
        raise ValueError("; ".join(problems))
    counts = list(explicit) if explicit else _balanced(n_layers, chunks, embedding_weight, head_weight)
    out, start = [], 0
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out


def _balanced(n_layers: int, chunks: int, embedding_weight: float, head_weight: float) -> list[int]:
    """Counts minimising the heaviest chunk, where chunk 0 also carries embedding_weight layers of work
    and the last chunk head_weight: greedy from a target load, then spread the remainder."""
    extra = [0.0] * chunks
    extra[0] += embedding_weight
    extra[-1] += head_weight
    total = n_layers + sum(extra)
    empty = _emptiable(chunks, embedding_weight, head_weight) if n_layers < chunks else set()
    least = [0 if i in empty else 1 for i in range(chunks)]
    counts = [max(low, round(total / chunks - e)) for low, e in zip(least, extra, strict=True)]
    # Fix the sum: take layers from / give layers to the chunks whose load is furthest from the target.
    while sum(counts) > n_layers:
        i = max((i for i in range(chunks) if counts[i] > least[i]), key=lambda i: counts[i] + extra[i])
        counts[i] -= 1
    while sum(counts) < n_layers:
        i = min(range(chunks), key=lambda i: counts[i] + extra[i])
        counts[i] += 1
    return counts


def split_by_cost(
    costs: Sequence[float], chunks: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Layer counts (each at least 1) of the contiguous split of layers with `costs` into `chunks` chunks
    whose largest chunk cost is least; chunk 0 also costs `first_extra` and the last `last_extra`."""
    n = len(costs)
    problems = split_problems(n, chunks)
    if problems:
        raise ValueError("; ".join(problems))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(chunk: int, start: int, stop: int) -> float:
        extra = (first_extra if chunk == 0 else 0.0) + (last_extra if chunk == chunks - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    # best[k][i]: (largest chunk cost, start of the last chunk) splitting layers [0, i) into k chunks.
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            best[k][i] = min((max(best[k - 1][j][0], cost(k - 1, j, i)), j) for j in range(k - 1, i))
    counts, i = [], n
    for k in range(chunks, 0, -1):
        j = best[k][i][1]
        counts.append(i - j)
        i = j
    return counts[::-1]


INF = float("inf")


def split_by_cost_v(
    costs: Sequence[float], pp: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Layer counts of the 2·pp chunks of a V (rank r holds chunks r and 2·pp−1−r, so chunk 0's
    `first_extra` and the last chunk's `last_extra` both land on rank 0) whose busiest *rank* is least.

    Rank k < pp−1 takes layers [a_k, a_k+1) on the way down and [b_k+1, b_k) on the way back, so with
    h[a, b] = cost of layers [a, b) its load is h[a_k, b_k] − h[a_k+1, b_k+1]; the last rank takes the
    middle [a, b) whole. Bisection on the answer T; for a given T the boundary pairs reachable by rank
    k+1 are those (a', b') whose quadrant a < a', b > b' holds a reachable pair with
    h[a, b] <= T + h[a', b'], a running minimum over the quadrant (O(pp·n²) per T)."""
    n = len(costs)
    problems = split_problems(n, 2 * pp)
    if problems:
        raise ValueError("; ".join(problems))
    if pp == 1:
        return split_by_cost(costs, 2, first_extra, last_extra)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    h = [[prefix[b] - prefix[a] if b >= a else INF for b in range(n + 1)] for a in range(n + 1)]
    extra = first_extra + last_extra
    lo = (prefix[-1] + extra) / pp  # no rank can carry less than the mean
    hi = _v_load(costs, split_by_cost(costs, 2 * pp, first_extra, last_extra), pp, extra)
    hi += 1e-9 * hi  # feasible, past the rounding of h's differences
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if _v_reach(h, pp, extra, mid) is None:
            lo = mid
        else:
            hi = mid
    reach = _v_reach(h, pp, extra, hi)
    assert reach is not None
    return _v_counts(h, reach, pp, extra, hi, costs)


def _v_load(costs: Sequence[float], counts: list[int], pp: int, extra: float) -> float:
    """The busiest rank's cost of a V split (rank 0 carries `extra`)."""
    bounds = list(itertools.accumulate(counts, initial=0))
    chunk = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    return max(chunk[r] + chunk[2 * pp - 1 - r] + (extra if r == 0 else 0.0) for r in range(pp))


def _v_reach(h: list[list[float]], pp: int, extra: float, limit: float) -> list[list[list[float]]] | None:
    """Per rank k, h at the boundary pairs (a_k, b_k) reachable with every earlier rank's load <= limit
    (+inf elsewhere); None if the last rank cannot stay under `limit`."""
    n = len(h) - 1
    start = [[INF] * (n + 1) for _ in range(n + 1)]
    start[0][n] = h[0][n]
    reach = [start]
    for k in range(pp - 1):
        room = 2 * (pp - k - 1)  # two layers at least per chunk still to come
        bound = limit - (extra if k == 0 else 0.0)
        above = [INF] * (n + 1)  # min over a < a' of the previous rank's row, column by column
        rows = []
        for a2 in range(n + 1):
            # quadrant[b'] = min over b > b' of above[b]
            quadrant = list(itertools.accumulate(reversed(above[1:] + [INF]), min))[::-1]
            rows.append(
                [hb if b2 - a2 >= room and quadrant[b2] <= bound + hb else INF for b2, hb in enumerate(h[a2])]
            )
            above = list(map(min, above, reach[-1][a2]))
        reach.append(rows)
    if min(min(row) for row in reach[-1]) > limit:
        return None
    return reach


def _v_counts(
    h: list[list[float]],
    reach: list[list[list[float]]],
    pp: int,
    extra: float,
    limit: float,
    costs: Sequence[float],
) -> list[int]:
    """Walk back from a feasible middle to rank 0, then list the 2·pp chunks' layer counts."""
    slack = 1e-9 * (limit + 1.0)
    n = len(h) - 1
    a, b = next((a, b) for a, row in enumerate(reach[-1]) for b, v in enumerate(row) if v <= limit + slack)
    lefts, rights = [a], [b]
    for k in range(pp - 2, -1, -1):
        bound = limit + slack - (extra if k == 0 else 0.0) + h[a][b]
        a, b = next((a0, b0) for a0 in range(a) for b0 in range(b + 1, n + 1) if reach[k][a0][b0] <= bound)
        lefts.append(a)
        rights.append(b)
    lefts, rights = lefts[::-1], rights[::-1]  # rank 0 first: (0, n), then inwards
    middle = split_by_cost(list(costs[lefts[-1] : rights[-1]]), 2)
    down = [lefts[k + 1] - lefts[k] for k in range(pp - 1)]
    up = [rights[k] - rights[k + 1] for k in range(pp - 1)]
    return [*down, *middle, *up[::-1]]
