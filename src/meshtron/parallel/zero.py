"""ZeRO-1 and ZeRO-2: optimizer state (and for stage 2, gradients) sharded over dp_shard.

Parameters stay whole on every rank. Each rank owns a dim-0 row block of every parameter (see
shard.py): its optimizer updates only those rows, through a parameter that is a view of them, so the
AdamW state exists for 1/dp_shard of the model. A step:

  backward   gradients reduce-scattered bucket by bucket from gradient hooks, overlapping backward
             (stage 1: on the last micro-batch only; the full gradients are kept and accumulated in
             `.grad`, and each rank's reduced rows are written back into its rows of `.grad`;
             stage 2: on every micro-batch, into a sharded accumulator, full gradients freed at once)
  replicas   with dp_replicate > 1 (hybrid), the reduced shards are all-reduced across replicas
  step       AdamW on the owned rows
  after_step updated rows all-gathered, bucket by bucket, into the whole parameters

Per step that moves a reduce-scatter and an all-gather of every parameter: 2Ψ(n-1)/n, like DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.comm import Comm, CommGroup, Pending
from meshtron.parallel.ddp import BucketedEngine, make_buckets
from meshtron.parallel.engine import OwnedRows
from meshtron.parallel.shard import FlatLayout


class _ShardedBucket:
    def __init__(self, params: list[nn.Parameter], shard: CommGroup, stage: int):
        self.params = params
        self.layout = FlatLayout([tuple(p.shape) for p in params], shard.size, shard.rank)
        self.row_ranges = [s.row_range(shard.rank) for s in self.layout.shapes]
        # This rank's rows of each parameter, as parameters of their own (views: no extra memory).
        self.owned = [
            nn.Parameter(p.data[slice(*rows)]) for p, rows in zip(params, self.row_ranges, strict=True)
        ]
        like = params[0].data
        # Stage 2 accumulates the reduced rows here over micro-batches; stage 1 writes them into `.grad`.
        self.grad_segment: torch.Tensor | None = None
        if stage == 2:
            self.grad_segment = torch.zeros(self.layout.shard_numel, dtype=like.dtype, device=like.device)
            views = self.layout.local_views(self.grad_segment, valid_only=True)
            for owned, view in zip(self.owned, views, strict=True):
                owned.grad = view
        self.pending: Pending | None = None
        self.received: torch.Tensor | None = None


class ZeroShardedOptimizer(BucketedEngine):
    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        shard: CommGroup,
        replicate: CommGroup,
        stage: int,
        bucket_bytes: int = 25 * 2**20,
        reduce_dtype: torch.dtype | None = None,
        shard_mesh: Any = None,
    ):
        if stage not in (1, 2):
            raise ValueError(f"ZeroShardedOptimizer handles stages 1 and 2, not {stage}")
        self.model, self.comm, self.shard, self.replicate, self.stage = model, comm, shard, replicate, stage
        self.shard_mesh = shard_mesh
        self.norm_group = shard
        self.reduce_dtype = reduce_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_dtype = self.params[0].dtype
        self.buckets = [_ShardedBucket(b, shard, stage) for b in make_buckets(self.params, bucket_bytes)]
        self._watch_buckets()

    def optimizer_params(self) -> list[nn.Parameter]:
        return [owned for bucket in self.buckets for owned in bucket.owned]

    def owned_rows(self) -> list[OwnedRows]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [
            OwnedRows(names[id(p)], owned, start, stop - start, tuple(p.shape))
            for bucket in self.buckets
            for p, owned, (start, stop) in zip(bucket.params, bucket.owned, bucket.row_ranges, strict=True)
        ]

    def load_owned_rows(self) -> None:
        self.after_step()  # every rank loaded only its rows; gather the whole parameters again

    def prepare_micro_batch(self, is_last: bool) -> None:
        self._collect()  # stage 2: fold the previous micro-batch's reduced rows into the accumulator
        self._start_micro_batch(sync=is_last or self.stage == 2)

    def _launch(self, bucket: _ShardedBucket) -> None:
        dtype = self.reduce_dtype or self.grad_dtype
        device = bucket.params[0].device
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        send = torch.empty(bucket.layout.shard_numel * self.shard.size, dtype=dtype, device=device)
        bucket.layout.pack(grads, send)
        if self.stage == 2:
            for p in bucket.params:
                p.grad = None  # the full gradient lives only until it is packed
        bucket.received = torch.empty(bucket.layout.shard_numel, dtype=dtype, device=device)
        bucket.pending = self.comm.reduce_scatter_async(bucket.received, send, self.shard)

    def _collect(self) -> None:
        for bucket in self.buckets:
            if bucket.pending is None or self.stage == 1:
                continue
            bucket.pending.wait()
            bucket.pending = None
            bucket.grad_segment.add_(bucket.received.to(self.grad_dtype))
            bucket.received = None

    def finish_gradients(self) -> None:
        for bucket in self.buckets:
            if self._needs_final_launch(bucket):
                self._collect()  # stage 2: the bucket's earlier reduction first
                self._launch(bucket)
        self._collect()
        for bucket in self.buckets:
            if self.stage == 2:
                self.comm.all_reduce_(bucket.grad_segment, self.replicate)
                continue
            bucket.pending.wait()
            bucket.pending = None
            reduced = self.comm.all_reduce_(bucket.received.to(self.grad_dtype), self.replicate)
            bucket.received = None
            views = bucket.layout.local_views(reduced, valid_only=True)
            for p, owned, rows, view in zip(
                bucket.params, bucket.owned, bucket.row_ranges, views, strict=True
            ):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                owned.grad = p.grad[slice(*rows)]  # this rank's reduced rows, inside the full gradient
                owned.grad.copy_(view)

    @torch.no_grad()
    def after_step(self) -> None:
        pending = []
        for bucket in self.buckets:
            like = bucket.params[0]
            segment = torch.empty(bucket.layout.shard_numel, dtype=like.dtype, device=like.device)
            bucket.layout.pack_local([p.data for p in bucket.params], segment)
            gathered = torch.empty(
                segment.numel() * self.shard.size, dtype=segment.dtype, device=segment.device
            )
            pending.append((bucket, gathered, self.comm.all_gather_async(gathered, segment, self.shard)))
        for bucket, gathered, handle in pending:
            handle.wait()
            bucket.layout.unpack(gathered, [p.data for p in bucket.params])

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if self.stage == 2:
                bucket.grad_segment.zero_()
                continue
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.zero_()

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.grad_segment for b in self.buckets if b.grad_segment is not None]
