"""Which transformer layers each pipeline chunk holds.

The model is cut into pp·vpp chunks (rank r holds chunks r, r + pp, ...). The embedding sits on the
first chunk and the final norm, output head and loss on the last. An even split can count the embedding
and the head+loss as `embedding_weight` and `head_weight` layers' worth of work, so the first and last
chunks get fewer transformer layers; or the caller gives the layer count of every chunk explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence


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
    if explicit is not None:
        if len(explicit) != chunks:
            raise ValueError(
                f"an explicit split needs one layer count per chunk: {chunks} chunks, "
                f"{len(explicit)} counts given"
            )
        if any(c < 1 for c in explicit) or sum(explicit) != n_layers:
            raise ValueError(
                f"explicit layer counts {list(explicit)} must be positive and add up to n_layers={n_layers}"
            )
        counts = list(explicit)
    else:
        if n_layers < chunks:
            raise ValueError(
                f"{n_layers} layers cannot fill {chunks} pipeline chunks (pp·vpp); use pp·vpp <= {n_layers}"
            )
        counts = _balanced(n_layers, chunks, embedding_weight, head_weight)
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


def chunks_of_rank(rank: int, pp: int, vpp: int) -> list[int]:
    """The global chunk indices rank `rank` holds, in forward order."""
    return [v * pp + rank for v in range(vpp)]
