"""The autograd rules of collectives.py's differentiable collectives (the table in collectives.py's docstring).

Each rule calls back into the `Comm` that applied it, so every collective still goes through collectives.py
(which counts and times it); this module holds only how gradients flow.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from meshtron.comm.counted import CountedCollectives
from meshtron.comm.group import CommGroup


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return comm.all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_reduce_(grad.clone(), ctx.group), None, None


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup, dim: int
    ) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        return comm.all_gather_tensor(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.reduce_scatter_tensor(grad, ctx.group, ctx.dim), None, None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup, dim: int
    ) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        # Not in place where a store may keep the partial sum (IN_PLACE: per-op recompute).
        return comm.reduce_scatter_tensor(x, group, dim, consume=not x.is_leaf and IN_PLACE.on)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_gather_tensor(grad, ctx.group, ctx.dim), None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup, split_dim: int, concat_dim: int
    ):
        ctx.comm, ctx.group, ctx.dims = comm, group, (split_dim, concat_dim)
        return comm.all_to_all_tensor(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        split_dim, concat_dim = ctx.dims
        return ctx.comm.all_to_all_tensor(grad, ctx.group, concat_dim, split_dim), None, None, None, None


class AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: CountedCollectives,
        group: CommGroup,
        out_splits: list,
        in_splits: list,
    ):
        ctx.comm, ctx.group, ctx.splits = comm, group, (out_splits, in_splits)
        return comm.all_to_all_single(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return ctx.comm.all_to_all_single(grad.contiguous(), ctx.group, in_splits, out_splits), *[None] * 4


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup, src: int
    ) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.src = comm, group, src
        return comm.broadcast_(x.clone(), group, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        summed = ctx.comm.reduce_(grad.clone(), ctx.group, ctx.src)
        if ctx.group.rank != ctx.src:
            summed = torch.zeros_like(grad)  # only the source's input reached the outputs
        return summed, None, None, None


class CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_reduce_(grad.clone(), ctx.group), None, None


class _InPlace(threading.local):
    """Whether ReduceFromGroup and ReduceScatter may reduce their input in place (per thread;
    `out_of_place`)."""

    on = True


IN_PLACE = _InPlace()


@contextlib.contextmanager
def out_of_place() -> Iterator[None]:
    """ReduceFromGroup copies its input first, and ReduceScatter never reduces it in place: for regions
    whose operation outputs a store keeps (per-operation recompute), where reducing a kept partial sum in
    place would change what is kept."""
    before, IN_PLACE.on = IN_PLACE.on, False
    try:
        yield
    finally:
        IN_PLACE.on = before


class ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup) -> torch.Tensor:
        # In place: the input is a partial sum only this reduction reads (no clone, no new buffer);
        # marked dirty, so autograd raises if anything had saved it for backward.
        if not IN_PLACE.on:
            return comm.all_reduce_(x.clone(), group)
        ctx.mark_dirty(x)
        return comm.all_reduce_(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: CountedCollectives, group: CommGroup, dim: int
    ) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        if x.shape[dim] % group.size:
            raise ValueError(
                f"split on '{group.name}': dim {dim} of size {x.shape[dim]} is not divisible "
                f"by the group size {group.size}"
            )
        return x.chunk(group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_gather_tensor(grad.contiguous(), ctx.group, ctx.dim), None, None, None
