"""DDP: replicated parameters, gradients all-reduced in buckets that overlap the backward pass.

Parameters are grouped into buckets of about `bucket_bytes`, in reverse registration order (the order
in which backward produces their gradients). Each parameter's `.grad` is a view into its bucket's flat
buffer, so autograd accumulates straight into the buffer; when the last gradient of a bucket has been
accumulated on the last micro-batch of a step, that bucket's all-reduce is launched asynchronously from
the gradient hook while backward carries on with earlier layers. The optimizer waits only at
`finish_gradients()`. Earlier micro-batches of a step communicate nothing.

The loss of every rank is already divided by the *global* token count, so the gradient is the sum over
ranks (no averaging step at all). `reduce_dtype` may narrow the all-reduce (e.g. to bf16, half the
bytes) while gradients accumulate in fp32.

All data-parallel engines (this one, ZeRO-1/2 in optim.py, FSDP in fsdp.py) share the interface of
`DataParallelEngine`, which is all the trainer calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtron.comm import Comm, CommGroup, Pending


@dataclass(frozen=True)
class OwnedRows:
    """Rows [start, start + rows) of logical parameter `name` (of `shape`), held by this rank in the
    first `rows` rows of the optimizer's tensor `param` (any rows after them are padding)."""

    name: str
    param: nn.Parameter
    start: int
    rows: int
    shape: tuple[int, ...]


class DataParallelEngine:
    """What the training loop needs from a data-parallel strategy."""

    model: nn.Module
    # The group whose ranks own disjoint rows of the parameters, and its DeviceMesh (None: every rank
    # holds whole parameters).
    shard: CommGroup | None = None
    shard_mesh: Any = None
    # The group over which partial gradient-norm sums are added up (None: nothing to add up).
    norm_group: CommGroup | None = None

    def owned_rows(self) -> list[OwnedRows]:
        """What this rank holds of every logical parameter, for checkpoints that any layout can read."""
        raise NotImplementedError

    def load_owned_rows(self) -> None:
        """Called after a checkpoint has been loaded into `owned_rows()` (e.g. to refresh full copies)."""

    def full_gradients(self, comm: Comm) -> dict[str, torch.Tensor]:
        """Every logical parameter's gradient at its logical shape (gathered from the owning ranks), as
        the single-device run would have it: what parity checks compare."""
        out = {}
        for entry in self.owned_rows():
            grad = entry.param.grad
            if grad is None:
                grad = torch.zeros_like(entry.param)
            if hasattr(grad, "full_tensor"):  # a DTensor (PyTorch's FSDP)
                out[entry.name] = grad.full_tensor().detach().clone()
                continue
            if self.shard is None or self.shard.size == 1:
                out[entry.name] = grad.detach().clone()
                continue
            per_rank = -(-entry.shape[0] // self.shard.size)
            padded = grad.new_zeros((per_rank, *entry.shape[1:]))
            padded[: entry.rows] = grad[: entry.rows]
            out[entry.name] = comm.all_gather_tensor(padded, self.shard)[: entry.shape[0]].clone()
        return out

    def optimizer_params(self) -> list[nn.Parameter]:
        """The tensors the optimizer updates (whole parameters or this rank's shards)."""
        raise NotImplementedError

    def prepare_micro_batch(self, is_last: bool) -> None:
        """Called before each micro-batch's forward; gradients are synchronised on the last one."""
        raise NotImplementedError

    def finish_gradients(self) -> None:
        """Wait for every reduction; afterwards the optimizer params' `.grad` hold the global gradient."""
        raise NotImplementedError

    def grad_norm_sq_parts(
        self, whole_on_every_tp_rank: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()
    ) -> torch.Tensor:
        """[split, whole]: sums of squares of the gradient elements this rank owns (each owned by one rank
        of `norm_group`), for parameters split over tensor parallel ranks and for those every tp rank
        holds whole (and so must be counted once, not tp times). Parameters in `skip` are left out."""
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for entry in self.owned_rows():
            grad = entry.param.grad
            if grad is None or entry.name in skip:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad[: entry.rows]
            parts[entry.name in whole_on_every_tp_rank].append(local)
        return torch.stack(
            [
                torch.stack(torch._foreach_norm(g)).float().pow(2).sum() if g else torch.zeros(())
                for g in parts
            ]
        )

    def scale_grads_(self, coef: torch.Tensor) -> None:
        grads = [p.grad for p in self.optimizer_params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient storage the engine keeps besides the parameters' `.grad` (for memory accounting)."""
        return []

    def after_step(self) -> None:
        """Called after the optimizer step (e.g. to all-gather updated shards)."""

    def zero_grad(self) -> None:
        raise NotImplementedError


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of about bucket_bytes, in reverse order (backward produces the last layer's
    gradients first)."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if buckets[-1] and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class BucketedEngine(DataParallelEngine):
    """Counts each bucket's ready gradients from post-accumulate-grad hooks and launches the bucket's
    collective (`_launch`) the moment its last gradient lands, while backward goes on."""

    params: list[nn.Parameter]
    buckets: list[Any]

    def _watch_buckets(self) -> None:
        self.sync = True
        # Parameters whose gradients were still outstanding when each bucket's collective started:
        # a positive first entry is the evidence that communication overlapped backward.
        self.launch_log: list[int] = []
        self._ready_total = 0
        for index, bucket in enumerate(self.buckets):
            bucket.ready, bucket.launched = 0, False
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda _p, i=index: self._on_grad_ready(i))

    def _start_micro_batch(self, sync: bool) -> None:
        """`sync`: count the gradients of the coming backward towards launching their buckets. Counts
        persist until a bucket launches, so a pipeline stage can sync one chunk's buckets at a time."""
        self.sync = sync
        self._ready_total = 0

    def _on_grad_ready(self, index: int) -> None:
        if not self.sync:
            return
        self._ready_total += 1
        bucket = self.buckets[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self.launch_log.append(len(self.params) - self._ready_total)
            bucket.ready = 0
            bucket.launched = True
            self._launch(bucket)

    def _needs_final_launch(self, bucket: Any) -> bool:
        """At the end of the step: a bucket some of whose parameters got no gradient (or none did) was
        not launched from the hooks; launch it now so that every rank runs the same collectives."""
        needed = bucket.ready > 0 or not bucket.launched
        bucket.ready, bucket.launched = 0, False
        return needed

    def _launch(self, bucket: Any) -> None:
        raise NotImplementedError


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        dtype = params[0].dtype
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        self.pending: Pending | None = None
        self.send: torch.Tensor | None = None  # narrowed copy when reducing in a smaller dtype
        offset = 0
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class DistributedDataParallel(BucketedEngine):
    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        group: CommGroup,
        bucket_bytes: int = 25 * 2**20,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.model, self.comm, self.group = model, comm, group
        self.reduce_dtype = reduce_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [_Bucket(b) for b in make_buckets(self.params, bucket_bytes)]
        self._watch_buckets()
        with torch.no_grad():
            for p in self.params:  # replicas start identical by construction; make it a fact
                comm.broadcast_(p.data, group, src=0)

    def optimizer_params(self) -> list[nn.Parameter]:
        return self.params

    def owned_rows(self) -> list[OwnedRows]:
        return [
            OwnedRows(name, p, 0, p.shape[0], tuple(p.shape)) for name, p in self.model.named_parameters()
        ]

    def prepare_micro_batch(self, is_last: bool) -> None:
        self._start_micro_batch(sync=is_last)

    def _launch(self, bucket: _Bucket) -> None:
        buffer = bucket.flat
        if self.reduce_dtype is not None and self.reduce_dtype != buffer.dtype:
            bucket.send = buffer = buffer.to(self.reduce_dtype)
        bucket.pending = self.comm.all_reduce_async(buffer, self.group)

    def finish_gradients(self) -> None:
        for bucket in self.buckets:
            if self._needs_final_launch(bucket):
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.pending.wait()
            bucket.pending = None
            if bucket.send is not None:
                bucket.flat.copy_(bucket.send)
                bucket.send = None

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()

    def grad_buffers(self) -> list[torch.Tensor]:
        return [bucket.flat for bucket in self.buckets]
