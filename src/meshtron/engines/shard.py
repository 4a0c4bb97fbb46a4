"""Dim-0 sharding of a group of parameters into one flat, rank-major buffer.

Every parameter is cut into `size` row blocks of its row shape (config/row_blocks.py: the parameter's
own [d0, *rest], ceil(d0 / size) rows each with the last ones zero-padded; or, for a stack of expert
matrices the group does not divide, its [E·F, *rest] rows, so that each rank holds a row block of one
expert's matrix and nothing is padded). Each rank's shard is a rectangle of the logical tensor, so any
other layout can be cut from a checkpoint of it. A group (a ZeRO bucket or an FSDP unit) concatenates
its parameters' shards per rank:

    flat [size * shard_numel] = [rank 0: p0 rows, p1 rows, ...][rank 1: p0 rows, p1 rows, ...] ...

which is exactly the input of a reduce-scatter (each rank receives its own segment) and the output of an
all-gather (each rank contributes its segment), so one collective serves the whole group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtron.config.row_blocks import row_shape


@dataclass(frozen=True)
class ShardedShape:
    """How one parameter is cut into `size` row blocks of `shape`, its row shape (`of` a parameter of
    `logical` shape: config/row_blocks.py; the two are the same unless a stack is cut within its
    matrices)."""

    shape: tuple[int, ...]
    size: int
    logical: tuple[int, ...] = ()  # empty: `shape`

    def __post_init__(self) -> None:
        if not self.logical:
            object.__setattr__(self, "logical", tuple(self.shape))

    @classmethod
    def of(cls, logical: tuple[int, ...], size: int, cut_within: bool = True) -> ShardedShape:
        return cls(row_shape(tuple(logical), size, cut_within), size, tuple(logical))

    @property
    def cut_within(self) -> bool:
        """Whether a stack is cut within its matrices (rows of `shape` are not rows of `logical`)."""
        return self.shape != self.logical

    def rows_of(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (contiguous, of the logical shape) viewed at the row shape."""
        return t.view(self.shape)

    @property
    def rows(self) -> int:
        return math.ceil(self.shape[0] / self.size) if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def shard_numel(self) -> int:
        return self.rows * self.row_numel

    def valid_rows(self, rank: int) -> int:
        """Rows of the logical tensor held by `rank` (the rest of its block is padding)."""
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))

    def row_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.rows, self.shape[0])
        return start, start + self.valid_rows(rank)


class FlatLayout:
    """Offsets of several dim-0 sharded parameters inside one rank-major flat buffer."""

    def __init__(self, shapes: list[tuple[int, ...]], size: int, rank: int, cut_within: bool = True):
        self.shapes = [ShardedShape.of(tuple(s), size, cut_within) for s in shapes]
        self.size, self.rank = size, rank
        self.offsets = [0]
        for s in self.shapes:
            self.offsets.append(self.offsets[-1] + s.shard_numel)
        self.shard_numel = self.offsets[-1]

    def local_views(self, segment: torch.Tensor, valid_only: bool = False) -> list[torch.Tensor]:
        """Per-parameter [rows, *rest] views (of each row shape) of this rank's `segment` (numel
        shard_numel); with valid_only, without the padding rows."""
        views = []
        for s, start in zip(self.shapes, self.offsets, strict=False):
            rows = s.valid_rows(self.rank) if valid_only else s.rows
            views.append(segment[start : start + rows * s.row_numel].view(rows, *s.shape[1:]))
        return views

    def _blocks(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """[size, rows, row_numel] view of parameter i's blocks inside a rank-major `flat` buffer."""
        s, start = self.shapes[i], self.offsets[i]
        per_rank = flat.view(self.size, self.shard_numel)[:, start : start + s.shard_numel]
        return per_rank.unflatten(1, (s.rows, s.row_numel))

    @torch.no_grad()
    def pack(self, tensors: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """Write full tensors (logical shapes) into a rank-major `flat` buffer, zeroing the padding."""
        for i, (s, t) in enumerate(zip(self.shapes, tensors, strict=True)):
            blocks = self._blocks(flat, i)
            rows_2d = t.reshape(s.shape[0], s.row_numel)
            whole = s.shape[0] // s.rows  # ranks whose block is entirely real rows
            blocks[:whole].copy_(rows_2d[: whole * s.rows].view(whole, s.rows, s.row_numel))
            if whole < self.size:
                tail = s.shape[0] - whole * s.rows
                blocks[whole, :tail].copy_(rows_2d[whole * s.rows :])
                blocks[whole, tail:].zero_()
                blocks[whole + 1 :].zero_()
        return flat

    @torch.no_grad()
    def unpack(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy a rank-major `flat` buffer (e.g. an all-gather result) into full tensors."""
        for i, (s, t) in enumerate(zip(self.shapes, tensors, strict=True)):
            blocks = self._blocks(flat, i)
            rows_2d = t.view(s.shape[0], s.row_numel)
            whole = s.shape[0] // s.rows
            rows_2d[: whole * s.rows].view(whole, s.rows, s.row_numel).copy_(blocks[:whole])
            if whole < self.size:
                rows_2d[whole * s.rows :].copy_(blocks[whole, : s.shape[0] - whole * s.rows])

    @torch.no_grad()
    def pack_local(self, tensors: list[torch.Tensor], segment: torch.Tensor) -> torch.Tensor:
        """Write this rank's rows of full tensors into its `segment` (an all-gather input), zero-padded."""
        for s, t, view in zip(self.shapes, tensors, self.local_views(segment), strict=True):
            start, stop = s.row_range(self.rank)
            view[: stop - start].copy_(t.reshape(s.shape)[start:stop])
            view[stop - start :].zero_()
        return segment
