"""DDP: replicated parameters, gradients all-reduced in buckets that overlap the backward pass.

Parameters are grouped into buckets of about `bucket_bytes`, in reverse registration order (the order
in which backward produces their gradients). Each parameter's `.grad` is a view into its bucket's flat
buffer, so autograd accumulates straight into the buffer; when the last gradient of a bucket has been
accumulated on the last micro-batch of a step, that bucket's all-reduce is launched asynchronously from
the gradient hook while backward carries on with earlier layers. The optimizer waits only at
`finish_gradients()`. Earlier micro-batches of a step communicate nothing.

The loss of every rank is already divided by the *global* token count, so the gradient is the sum over
ranks (no averaging step at all). `reduce_dtype` may narrow the all-reduce (e.g. to bf16, half the
bytes) while gradients accumulate in fp32. ZeRO-1/2 (zero.py) reuse the buckets and their hooks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from meshtron.comm.group import CommGroup
from meshtron.comm.pending import Pending
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.engines.mixed_precision import accumulate_in_fp32, to_compute_dtype_
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel


def make_buckets(
    params: list[nn.Parameter], bucket_bytes: int, grad_bytes: int | None = None
) -> list[list[nn.Parameter]]:
    """Consecutive groups of about bucket_bytes of gradient (`grad_bytes` per element, default the
    parameter's), in reverse order (backward produces the last layer's gradients first)."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * (grad_bytes or p.element_size())
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
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
        engine = weakref.proxy(self)  # see FullyShardedDataParallel's hooks (fsdp.py)
        for index, bucket in enumerate(self.buckets):
            bucket.ready, bucket.launched, bucket.expected = 0, False, len(bucket.params)
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda _p, i=index, e=engine: e._on_grad_ready(i))

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
        if bucket.ready == bucket.expected:
            self.launch_log.append(len(self.params) - self._ready_total)
            bucket.ready = 0
            bucket.launched = True
            self._launch(bucket)

    def expect_grad_uses(self, param: nn.Parameter, uses: int) -> None:
        """`param` gets its final gradient in `uses` separate backward calls (a pipeline's embedding table
        or its tied copy: PipelineRuntime.embedding_grad_calls): its bucket waits for all."""
        for bucket in self.buckets:
            if any(p is param for p in bucket.params):
                bucket.expected += uses - 1

    def _needs_final_launch(self, bucket: Any) -> bool:
        """At the end of the step: a bucket some of whose parameters got no gradient (or none did) was
        not launched from the hooks; launch it now so that every rank runs the same collectives."""
        needed = bucket.ready > 0 or not bucket.launched
        bucket.ready, bucket.launched = 0, False
        return needed

    def _launch(self, bucket: Any) -> None:
        raise NotImplementedError


class _Bucket:
    def __init__(self, params: list[nn.Parameter], masters: list[nn.Parameter] | None = None):
        """`masters`: fp32 master weights of bf16 `params` (mixed_precision.py): the buffer holds their
        gradients, into which the parameters' are accumulated; None: the parameters' own `.grad`."""
        self.params = params
        dtype = torch.float32 if masters is not None else params[0].dtype
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        self.pending: Pending | None = None
        self.send: torch.Tensor | None = None  # narrowed copy when reducing in a smaller dtype
        offset = 0
        for i, p in enumerate(params):
            view = self.flat[offset : offset + p.numel()].view_as(p)
            if masters is None:
                p.grad = view
            else:
                masters[i].grad = view
                accumulate_in_fp32(p, view)
            offset += p.numel()


class DistributedDataParallel(BucketedEngine):
    def __init__(self, wrapped: EngineModel, groups: EngineGroups, settings: DataParallelSettings):
        """Gradients all-reduced over `groups.replicate`; the replicas made identical from rank 0's values
        unless `wrapped.identical_replicas`. `settings.param_dtype` other than fp32: the parameters become
        that compute copy, with fp32 masters (mixed_precision.py)."""
        model, comm, group = wrapped.model, groups.comm, groups.replicate
        param_dtype, bucket_bytes = settings.param_dtype, settings.bucket_bytes
        self.model, self.comm, self.group = model, comm, group
        self.reduce_dtype = settings.reduce_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters: list[nn.Parameter] | None = None
        if param_dtype != torch.float32:
            values = to_compute_dtype_(self.params, param_dtype)
            self.masters = [nn.Parameter(v) for v in values]
        of = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = [
            _Bucket(b, None if self.masters is None else [self.masters[of[id(p)]] for p in b])
            for b in make_buckets(self.params, bucket_bytes, grad_bytes=4 if self.masters else None)
        ]
        self._watch_buckets()
        with torch.no_grad():
            for p in () if wrapped.identical_replicas else self.params:  # replicas start identical:
                comm.broadcast_(p.data, group, src=0)  # make it a fact

    def optimizer_params(self) -> list[nn.Parameter]:
        return self.params if self.masters is None else self.masters

    def matrix_group(self) -> tuple[CommGroup | None, bool]:
        return self.group, False  # every replica holds every parameter whole

    def owned_rows(self) -> list[OwnedRows]:
        held = dict(zip(map(id, self.params), self.optimizer_params(), strict=True))
        return [
            OwnedRows(name=name, param=held[id(p)], start=0, rows=p.shape[0], shape=tuple(p.shape))
            for name, p in self.model.named_parameters()
        ]

    @torch.no_grad()
    def after_step(self) -> None:
        for p, master in zip(self.params, self.masters or [], strict=False):
            p.copy_(master)  # the new values into the compute copies

    def load_owned_rows(self) -> None:
        self.after_step()

    def prepare_micro_batch(self, is_last: bool) -> None:
        self._start_micro_batch(sync=is_last)

    def _launch(self, bucket: _Bucket) -> None:
        buffer = bucket.flat
        if self.reduce_dtype != buffer.dtype:
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
