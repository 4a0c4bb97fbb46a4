"""How the sharded engines cut a parameter into row blocks over a group of ranks, torch-free: the
engines (engines/shard.py) and the planner (plan/state.py, plan/comm.py) read the same rule.

  parameter                         rows the group splits               each rank holds
  [d0, *rest]                       d0, in blocks of ceil(d0 / n)       rows of the tensor (the last
                                                                        ranks' blocks zero-padded)
  a stack [E, F, *rest] (grouped    E·F, in blocks of E·F / n, when     rows of one matrix: a box
  experts) whose E the group does   n divides E·F and each block lies   [1, E·F/n, *rest] of the stack
  not divide                        inside one matrix (F divisible by
                                    the block's rows); else as above

The second line is why this module exists. A stack of 16 local experts over 32 expert-data-parallel
ranks cut along E would give half the ranks a block of padding alone: half of every ZeRO-3 gather and
reduce-scatter, and half of the experts' shards' memory, would be zeros (Qwen3-235B under FSDP with ep 8
on 256 GPUs). Cut as its [E·F, D] rows, each rank holds half of one expert's matrix and nothing is
padded. torchtitan meets the same case by sharding experts along their second dim under FSDP2.

Either way a rank's block is one rectangle of the parameter (a checkpoint records where it sits, any
layout can read it back) and one contiguous run of its memory (a flat buffer holds it as is).
`cut_within=False` keeps whole matrices on a rank (padding where the group does not divide E): Muon
orthogonalizes each expert's matrix where it lives, so it needs them whole (train/muon.py).
"""

from __future__ import annotations

import math
from functools import lru_cache


def row_shape(shape: tuple[int, ...], size: int, cut_within: bool = True) -> tuple[int, ...]:
    """The shape whose dim-0 rows the group of `size` splits: `shape`, or a stack's [E·F, *rest]."""
    if not cut_within or len(shape) < 3 or shape[0] % size == 0:
        return tuple(shape)
    rows = shape[0] * shape[1]
    if rows % size or shape[1] % (rows // size):
        return tuple(shape)
    return (rows, *shape[2:])


def block_rows(shape: tuple[int, ...], size: int, cut_within: bool = True) -> int:
    """Rows (of `row_shape`) in each rank's block, padding included."""
    rows = row_shape(shape, size, cut_within)
    return math.ceil(rows[0] / size) if rows else 1


@lru_cache(maxsize=65536)  # (the planner asks for the same few shapes millions of times)
def padded_numel(shape: tuple[int, ...], size: int, cut_within: bool = True) -> int:
    """Elements of all `size` blocks together: what one gather or reduce-scatter of `shape` moves."""
    if not shape:
        return size
    return block_rows(shape, size, cut_within) * size * math.prod(row_shape(shape, size, cut_within)[1:])


def block_box(
    shape: tuple[int, ...], rows_shape: tuple[int, ...], start: int, rows: int
) -> tuple[list[int], list[int]]:
    """(offsets, sizes) in `shape` of rows [start, start + rows) of its row shape `rows_shape`."""
    offsets, sizes = [0] * len(shape), list(shape)
    if tuple(rows_shape) == tuple(shape):
        offsets[0], sizes[0] = start, rows
        return offsets, sizes
    per = shape[1]
    offsets[0], offsets[1] = divmod(start, per)
    sizes[0], sizes[1] = (1, rows) if rows else (0, 0)
    return offsets, sizes
