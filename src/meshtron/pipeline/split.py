"""Which transformer layers each pipeline chunk holds.

The model is cut into pp·vpp chunks (which rank holds which: schedules.chunks_of_rank). The embedding sits on the
first chunk and the final norm, output head and loss on the last. An even split can count the embedding
and the head+loss as `embedding_weight` and `head_weight` layers' worth of work, so the first and last
chunks get fewer transformer layers; or the caller gives the layer count of every chunk explicitly.
"""

from __future__ import annotations

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
        if len(explicit) != chunks or any(n < 1 for n in explicit) or sum(explicit) != n_layers:
            problems.append(
                f"parallel.pp_layers={list(explicit)} must give pp*vpp={chunks} positive layer counts "
                f"adding up to model.n_layers={n_layers}"
            )
        if embedding_weight or head_weight:
            problems.append(
                "parallel.pp_layers gives the split explicitly; parallel.pp_embedding_layers and "
                "parallel.pp_head_layers only weigh a balanced split: set one or the other"
            )
    elif n_layers < chunks:
        problems.append(
            f"model.n_layers={n_layers} cannot fill pp*vpp={chunks} pipeline chunks; use pp*vpp <= {n_layers}"
        )
    return problems


def split_layers(
    n_layers: int,
    chunks: int,
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
    explicit: Sequence[int] | None = None,
) -> list[list[int]]:
    """Layer indices of every chunk, in order; every chunk gets at least one layer."""
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
    counts = [max(1, round(total / chunks - e)) for e in extra]
    # Fix the sum: take layers from / give layers to the chunks whose load is furthest from the target.
    while sum(counts) > n_layers:
        i = max((i for i in range(chunks) if counts[i] > 1), key=lambda i: counts[i] + extra[i])
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
