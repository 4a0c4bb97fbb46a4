"""torch's `fully_shard` (FSDP2) with its bytes counted like meshtron's own (collectives.py's docstring).

FSDP2 issues its collectives itself, so the comm layer's counter would not see them. It lets a caller
replace them, per module: `FSDPModule.set_custom_all_gather` and `set_custom_reduce_scatter` take an
object with `allocate(size, dtype=, device=)` and a call that issues the collective on the process group
FSDP2 passes. The two classes here issue exactly what torch's defaults issue (one `all_gather_single`,
one `reduce_scatter_single`, on FSDP2's group, with its op) and book their bytes on meshtron's named
group first; HSDP's all-reduce of the gradient shards across replicas stays torch's own, and its bytes
are booked by FSDP2's post-reduce hook (`set_all_reduce_hook`), called after that all-reduce.

  collective (per FSDP2 unit)          counted as
  all-gather into `out`                 bytes(out)·(n−1)/n on the shard group
  reduce-scatter of `inp`               bytes(inp)·(n−1)/n on the shard group
  HSDP all-reduce of the shard `g`      2·bytes(g)·(r−1)/r on the replicate group
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm.counted import CountedCollectives, _nbytes
from meshtron.comm.group import CommGroup


# Looked up at each call, as FSDP2's defaults do (benchmarks/data_parallel.py wraps them to count FSDP2's
# collectives its own way); older torch releases name them *_into_tensor / *_tensor.
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


def _fraction(group: CommGroup) -> float:
    return (group.size - 1) / group.size


class _CountedComm:
    """What FSDP2's custom collectives share: its default allocation (a plain tensor per call), and the
    comm layer's counter with the group to book on."""

    def __init__(self, counted: CountedCollectives, group: CommGroup):
        self.counted, self.group = counted, group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_CountedComm):
    """FSDP2's all-gather of a unit's parameter shards, counted on `group` (the shard group's name)."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        nbytes = _nbytes(output_tensor) * _fraction(self.group)
        self.counted.stats.record(self.group.name, "all_gather", nbytes)
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(_CountedComm):
    """FSDP2's reduce-scatter of a unit's gradients, counted on `group` (the shard group's name)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        nbytes = _nbytes(input_tensor) * _fraction(self.group)
        self.counted.stats.record(self.group.name, "reduce_scatter", nbytes)
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_fsdp2(
    module: Any, counted: CountedCollectives, shard: CommGroup, replicate: CommGroup | None
) -> None:
    """Route `module`'s (an FSDPModule's) all-gathers and reduce-scatters through the counting classes,
    and book its replicas' all-reduce where FSDP2 runs HSDP over `replicate` (None: it does not; the
    hook would then run after the reduce-scatter alone)."""
    module.set_custom_all_gather(CountedAllGather(counted, shard))
    module.set_custom_reduce_scatter(CountedReduceScatter(counted, shard))
    if replicate is not None and replicate.size > 1:

        def book_all_reduce(reduced: torch.Tensor) -> None:
            counted.stats.record(replicate.name, "all_reduce", 2 * _nbytes(reduced) * _fraction(replicate))

        module.set_all_reduce_hook(book_all_reduce)
