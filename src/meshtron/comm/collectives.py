"""All communication: collectives with their autograd rules, byte accounting, and timeouts.

Every call goes through a `Comm` object (the collectives themselves are counted.py's), which counts bytes and calls per group and per step, and waits on each collective with a
deadline so a hang turns into an error that names the rank, the collective and the group.

Bytes are counted as the per-rank volume of a ring algorithm (docs/theory.md#communication-volume): all-reduce
of S bytes over n ranks 2*S*(n-1)/n; all-gather, reduce-scatter (S the unsharded size), all-to-all and
broadcast S*(n-1)/n; send/recv S. A group of size 1 moves and counts nothing. Every wait is timed
(timing.py: the straggler report's waits per group).
This is the volume of the collective asked for: gloo has no reduce-scatter of its own and runs one as
an all-reduce, so on gloo a reduce-scatter really moves twice its counted bytes. Gloo's all-gathers go
as every pair's messages at once (pairwise.py: faster there), which move the counted bytes.

Autograd rules (SPMD: the loss is the sum of every rank's loss):
  all_reduce      forward sum over ranks       backward all_reduce
  all_gather      forward concat               backward reduce_scatter
  reduce_scatter  forward sum + split          backward all_gather
  all_to_all      forward exchange chunks      backward the reverse exchange
  all_to_all_v    forward uneven rows          backward the reverse exchange (splits swapped)
  broadcast       forward copy from src        backward sum of grads to src
Tensor parallel also needs the pairs whose other side is replicated (Megatron's f and g):
  copy_to_group   forward identity             backward all_reduce
  reduce_from_group forward all_reduce         backward identity
  split_to_group  forward keep own chunk       backward all_gather
(the rules live in autograd.py; each calls back into its `Comm`). One more, for torch.compile:
  gather_rows_traced  forward all-gather       backward reduce-scatter (functional collectives a
                      compiler traces and may bucket; the caller books the bytes: `book`)

Lanes: a thread inside `pair_lane()` issues every collective on its group's twin (`add_pair_lane`), so
that two threads (a DualPipeV pair's forward and backward) never interleave their calls on one group.
"""

from __future__ import annotations

from typing import Any

import torch

# The functional (out-of-place, traceable) collectives torch.compile puts in its graphs have no public
# module yet; SimpleFSDP's compiled path needs them (gather_rows_traced).
import torch.distributed._functional_collectives as functional

from meshtron.comm.autograd import (
    AllGather,
    AllReduce,
    AllToAll,
    AllToAllV,
    Broadcast,
    CopyToGroup,
    ReduceFromGroup,
    ReduceScatter,
    SplitToGroup,
)
from meshtron.comm.counted import CountedCollectives, eager
from meshtron.comm.group import CommGroup

_gather_functional = getattr(functional, "all_gather_single", functional.all_gather_tensor)
_reduce_scatter_functional = getattr(functional, "reduce_scatter_single", functional.reduce_scatter_tensor)


class Comm(CountedCollectives):
    """The counted collectives, and the differentiable ones built on them (the table above)."""

    @eager
    def all_reduce(self, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return AllReduce.apply(x, self, group) if group.size > 1 else x

    @eager
    def all_gather(self, x: torch.Tensor, group: CommGroup, dim: int = 0) -> torch.Tensor:
        return AllGather.apply(x, self, group, dim) if group.size > 1 else x

    @eager
    def reduce_scatter(self, x: torch.Tensor, group: CommGroup, dim: int = 0) -> torch.Tensor:
        """Differentiable; consumes `x` (a partial sum no one else reads: a row-parallel or MoE output)."""
        return ReduceScatter.apply(x, self, group, dim) if group.size > 1 else x

    @eager
    def all_to_all(self, x: torch.Tensor, group: CommGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
        return AllToAll.apply(x, self, group, split_dim, concat_dim) if group.size > 1 else x

    @eager
    def all_to_all_v(
        self, x: torch.Tensor, group: CommGroup, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        """Differentiable `all_to_all_single`: rows input_splits[j] go to rank j (expert dispatch)."""
        return AllToAllV.apply(x, self, group, output_splits, input_splits) if group.size > 1 else x

    @eager
    def broadcast(self, x: torch.Tensor, group: CommGroup, src: int = 0) -> torch.Tensor:
        return Broadcast.apply(x, self, group, src) if group.size > 1 else x

    @eager
    def copy_to_group(self, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return CopyToGroup.apply(x, self, group) if group.size > 1 else x

    @eager
    def reduce_from_group(self, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """Differentiable all-reduce in place of `x` (a partial sum no one else reads: a row-parallel,
        vocab-parallel embedding or MoE output), returned as the sum; a leaf tensor is copied first."""
        if group.size == 1:
            return x
        return ReduceFromGroup.apply(x.clone() if x.is_leaf else x, self, group)

    @eager
    def split_to_group(self, x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
        return SplitToGroup.apply(x, self, group, dim) if group.size > 1 else x

    def gather_rows_traced(
        self, x: torch.Tensor, group: CommGroup, reduce_dtype: torch.dtype
    ) -> torch.Tensor:
        """Every rank's `x` concatenated along dim 0 through functional collectives torch.compile traces
        (backward: reduce-scatter in `reduce_dtype`); counts nothing: callers `book` the bytes."""
        return TracedGather.apply(x, group, reduce_dtype) if group.size > 1 else x


class TracedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype, ctx.dtype = group, reduce_dtype, x.dtype
        return _gather_functional(x.contiguous(), 0, group.process_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        send = grad.to(ctx.reduce_dtype).contiguous()
        shard = _reduce_scatter_functional(send, "sum", 0, ctx.group.process_group)
        return shard.to(ctx.dtype), None, None
