"""Whole matrices for Muon's Newton-Schulz from the pieces ranks hold, one owner per matrix.

A group of ranks holds the pieces of a list of matrices: every rank a block of each along the matrix's
split dim (ZeRO and FSDP: row blocks of ceil(rows / n); tensor parallel: equal blocks along the dim it
cuts), or every rank the whole of each (DDP's replicas). Each matrix gets one owner, the same on every
rank, balancing the Newton-Schulz FLOPs (`assign_owners`). Then, per step:

  gather    one all-to-all: each rank sends its block of each matrix to the matrix's owner, which
            concatenates the blocks along the split dim (whole copies: nothing to send)
  (the owner orthogonalizes)
  scatter   one all-to-all: the owner sends each rank its block of the result (whole copies: the whole
            result to every other rank)

The data-parallel level runs in buckets (`buckets`): `gather_async` and `scatter_async` take a bucket's
pieces, and return a call that waits.

Bytes a rank sends per step, elements times the Newton-Schulz dtype's size, n ranks:
  blocks        Σ over matrices others own of its block, + Σ over matrices it owns of the others' blocks
  whole copies  (n − 1) · Σ over the matrices it owns of their elements
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.plan.muon import assign_owners


@dataclass
class Piece:
    """One matrix as a group holds it: its name (owners' ties), whole shape, the dim its holders split
    it along, and its owner."""

    key: str
    shape: tuple[int, int]
    dim: int = 0
    owner: int = 0


class MatrixExchange:
    """The gather to the owners and the scatter back, over `group` (None: a group of one).

    Args:
        pieces: the matrices, in the same order on every rank of the group.
        comm: the counted collectives.
        group: the ranks holding them.
        split: whether each rank holds a block of each (True) or the whole of each (False).
        dtype: what the blocks travel in (Newton-Schulz's dtype: its input is cast to it anyway).
        steps: Newton-Schulz steps (the owners' balance).
        device: where the buffers live.
    """

    def __init__(
        self,
        pieces: list[Piece],
        comm: Comm,
        group: CommGroup | None,
        split: bool,
        dtype: torch.dtype,
        steps: int,
        device: torch.device,
    ):
        self.pieces, self.comm, self.group, self.split, self.dtype = pieces, comm, group, split, dtype
        self.device = device
        self.size, self.rank = (group.size, group.rank) if group is not None else (1, 0)
        for piece, owner in zip(
            pieces, assign_owners([p.shape for p in pieces], self.size, steps), strict=True
        ):
            piece.owner = owner

    def block(self, piece: Piece, rank: int) -> tuple[int, int]:
        """[start, stop) along the split dim of what `rank` holds of `piece`."""
        n = piece.shape[piece.dim]
        if not self.split:
            return 0, n
        per = -(-n // self.size)
        start = min(rank * per, n)
        return start, min(n, start + per)

    def _block_shape(self, piece: Piece, rank: int) -> list[int]:
        start, stop = self.block(piece, rank)
        shape = list(piece.shape)
        shape[piece.dim] = stop - start
        return shape

    def _numel(self, piece: Piece, rank: int) -> int:
        rows, cols = self._block_shape(piece, rank)
        return rows * cols

    def owned(self, idx: list[int] | None = None) -> list[int]:
        """The pieces (of `idx`, else all) this rank owns."""
        return [
            i for i in (range(len(self.pieces)) if idx is None else idx) if self.pieces[i].owner == self.rank
        ]

    def buckets(self, limit: int) -> list[list[int]]:
        """The pieces in consecutive groups of at most `limit` elements of whole matrices (a larger one
        alone): one exchange each, so that one bucket's Newton-Schulz runs while the next one travels."""
        out: list[list[int]] = [[]]
        size = 0
        for i, piece in enumerate(self.pieces):
            n = piece.shape[0] * piece.shape[1]
            if out[-1] and size + n > limit:
                out.append([])
                size = 0
            out[-1].append(i)
            size += n
        return out if out[-1] else []

    def gather_async(
        self, idx: list[int], blocks: dict[int, torch.Tensor]
    ) -> Callable[[], dict[int, torch.Tensor]]:
        """Start the exchange of pieces `idx` to their owners; the returned call waits and gives the
        owned ones whole (in `dtype` when they came over the group)."""
        mine = self.owned(idx)
        if not self.split or self.size == 1 or not idx:
            return lambda: {i: blocks[i] for i in mine}
        send, receive = [0] * self.size, [0] * self.size
        for i in idx:
            send[self.pieces[i].owner] += self._numel(self.pieces[i], self.rank)
        for i in mine:
            for j in range(self.size):
                receive[j] += self._numel(self.pieces[i], j)
        order = sorted(idx, key=lambda i: self.pieces[i].owner)  # by destination, stable
        flat = torch.cat([blocks[i].to(self.dtype).reshape(-1) for i in order])
        out, pending = self.comm.all_to_all_single_async(flat, self.group, receive, send)

        def finish() -> dict[int, torch.Tensor]:
            pending.wait()
            got, offsets, whole = out.split(receive), [0] * self.size, {}
            for i in mine:  # each source's chunk holds its blocks of the owned pieces, in order
                parts = []
                for j, chunk in enumerate(got):
                    n = self._numel(self.pieces[i], j)
                    parts.append(
                        chunk[offsets[j] : offsets[j] + n].view(self._block_shape(self.pieces[i], j))
                    )
                    offsets[j] += n
                whole[i] = torch.cat(parts, dim=self.pieces[i].dim)
            return whole

        return finish

    def scatter_async(
        self, idx: list[int], done: dict[int, torch.Tensor]
    ) -> Callable[[], dict[int, torch.Tensor]]:
        """Start sending each rank its block of the pieces `idx` this rank owns (`done`); the returned
        call waits and gives this rank's block of each of `idx`."""
        if self.size == 1 or not idx:
            return lambda: {i: done[i] for i in idx}
        me, mine = self.rank, self.owned(idx)
        others = [j for j in range(self.size) if self.split or j != me]
        send, receive, parts = [0] * self.size, [0] * self.size, []
        for j in others:
            for i in mine:
                start, stop = self.block(self.pieces[i], j)
                parts.append(done[i].narrow(self.pieces[i].dim, start, stop - start).reshape(-1))
                send[j] += parts[-1].numel()
            receive[j] = sum(self._numel(self.pieces[i], me) for i in idx if self.pieces[i].owner == j)
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        out, pending = self.comm.all_to_all_single_async(
            torch.cat(parts) if parts else empty, self.group, receive, send
        )

        def finish() -> dict[int, torch.Tensor]:
            pending.wait()
            back = {i: done[i] for i in mine} if not self.split else {}
            chunks = out.split(receive)
            for j in others:
                offset = 0
                for i in (i for i in idx if self.pieces[i].owner == j):
                    n = self._numel(self.pieces[i], me)
                    back[i] = chunks[j][offset : offset + n].view(self._block_shape(self.pieces[i], me))
                    offset += n
            return back

        return finish
