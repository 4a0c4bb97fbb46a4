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
  after_step updated rows all-gathered unit by unit (the root's parameters, then each block) into the
             whole parameters: two units in flight; the next forward waits for a unit in the unit's
             forward pre-hook and launches the one after the two in flight, so the gathers overlap the
             end of this step, the data of the next and the forward of the blocks before

Per step that moves a reduce-scatter and an all-gather of every parameter: 2Ψ(n-1)/n, like DDP.

Buffers are allocated once and reused every step, so a steady-state step allocates nothing for its
communication: each bucket keeps its received and owned-row segments (1/n of the bucket each), and the
full-size staging of the reduce-scatter's input and the all-gather's output is two bucket-sized buffers
used in turn (staging.py), not one per bucket: per-bucket full buffers would hold another copy of every
gradient, the memory ZeRO-2 exists to save.

Stage 1 keeps whole gradients anyway. Where the backend's reduce-scatter is an all-reduce of the whole
input (gloo has none of its own), packing them rank-major only to all-reduce the packed copy is wasted
work: there (without replicas) stage 1 keeps its gradients in one flat buffer per bucket, as DDP does,
all-reduces it in place and steps its rows of it, views all: what gloo's reduce-scatter does, without
the two copies, and counted as that reduce-scatter is.

The whole parameters are current once forward has reached them, or after `finish_params()` (the Trainer
calls it at the end of a run; reading parameters outside a forward needs it). Gathering per unit rather
than per gradient bucket follows forward order (buckets follow backward order, and one 25 MiB bucket can
hold a whole small model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.comm.group import CommGroup
from meshtron.comm.pending import Pending
from meshtron.engines.ddp import BucketedEngine, make_buckets
from meshtron.engines.engine import OwnedRows
from meshtron.engines.mixed_precision import accumulate_in_fp32, to_compute_dtype_
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel
from meshtron.engines.shard import FlatLayout
from meshtron.engines.staging import Staging


class _ShardedBucket:
    def __init__(
        self,
        params: list[nn.Parameter],
        shard: CommGroup,
        stage: int,
        reduce_dtype: torch.dtype,
        in_place: bool,
        mixed: bool = False,
        cut_within: bool = True,
    ):
        """`mixed`: `params` hold bf16 compute copies (mixed_precision.py): the owned rows are fp32
        masters of their own, and stage 1 accumulates whole gradients in an fp32 buffer. `cut_within`:
        how stacks of matrices are cut (config/row_blocks.py); rows below are rows of each row shape."""
        self.params = params
        self.layout = FlatLayout([tuple(p.shape) for p in params], shard.size, shard.rank, cut_within)
        self.row_ranges = [s.row_range(shard.rank) for s in self.layout.shapes]
        rows_of = [s.rows_of for s in self.layout.shapes]
        like = params[0].data
        if mixed:  # this rank's rows of each parameter as fp32 masters, in one segment
            self.master_segment = torch.zeros(
                self.layout.shard_numel, dtype=torch.float32, device=like.device
            )
            views = self.layout.local_views(self.master_segment, valid_only=True)
            for view, p, rows, of in zip(views, params, self.row_ranges, rows_of, strict=True):
                view.copy_(of(p.data)[slice(*rows)])
            self.owned = [nn.Parameter(view) for view in views]
        else:  # this rank's rows of each parameter, as parameters of their own (views: no extra memory)
            self.owned = [
                nn.Parameter(of(p.data)[slice(*rows)])
                for p, rows, of in zip(params, self.row_ranges, rows_of, strict=True)
            ]
        grad_dtype = torch.float32 if mixed else like.dtype
        # Stage 2 accumulates the reduced rows here over micro-batches; stage 1 writes them into `.grad`.
        self.grad_segment: torch.Tensor | None = None
        if stage == 2:
            self.grad_segment = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=like.device)
            views = self.layout.local_views(self.grad_segment, valid_only=True)
            for owned, view in zip(self.owned, views, strict=True):
                owned.grad = view
        self.pending: Pending | None = None
        self.flat: torch.Tensor | None = None
        self.send: torch.Tensor | None = None  # narrowed copy of `flat` when reducing in a smaller dtype
        # Stage 1 under mixed precision: each parameter's whole fp32 gradient, a view of `flat`.
        self.whole_grads: list[torch.Tensor] | None = None
        if in_place or (mixed and stage == 1):  # gradients live in one flat buffer, as DDP's do
            self.flat = torch.zeros(sum(p.numel() for p in params), dtype=grad_dtype, device=like.device)
            offset, self.whole_grads = 0, []
            for p, owned, rows, of in zip(params, self.owned, self.row_ranges, rows_of, strict=True):
                view = self.flat[offset : offset + p.numel()].view_as(p)
                if mixed:
                    accumulate_in_fp32(p, view)
                else:
                    p.grad = view
                self.whole_grads.append(view)
                owned.grad = of(view)[slice(*rows)]
                offset += p.numel()
            self.in_place = in_place
            if in_place:
                return
        self.in_place = False
        self.received = torch.empty(self.layout.shard_numel, dtype=reduce_dtype, device=like.device)


class _GatherUnit:
    """Parameters one module's forward reads, all-gathered together after the step."""

    def __init__(self, params: list[nn.Parameter], shard: CommGroup, cut_within: bool = True):
        self.params = params
        self.layout = FlatLayout([tuple(p.shape) for p in params], shard.size, shard.rank, cut_within)
        like = params[0].data
        self.segment = torch.empty(self.layout.shard_numel, dtype=like.dtype, device=like.device)
        self.pending: Pending | None = None
        self.gathered: torch.Tensor | None = None  # the staging buffer the gather writes
        self.full_numel = self.layout.shard_numel * shard.size

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.layout.unpack(self.gathered, [p.data for p in self.params])
            self.gathered = None


def gather_units(
    model: nn.Module | Any, params: list[nn.Parameter], blocks: list[nn.Module], roots: list[nn.Module] | None
) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """(module whose forward pre-hook waits, its parameters) in forward order: the root's parameters
    (embedding, final norm, head: read first and last) and each block's."""
    mine = {id(p) for p in params}
    in_blocks = [[p for p in b.parameters() if id(p) in mine] for b in blocks]
    in_any = {id(p) for group in in_blocks for p in group}
    rest = [p for p in params if id(p) not in in_any]
    hooked = roots or [model]
    if rest and not all(isinstance(m, nn.Module) for m in hooked):
        raise ValueError("ZeRO-1/2: parameters outside the blocks need a root module to wait in")
    units = [(hooked, rest), *(([b], group) for b, group in zip(blocks, in_blocks, strict=True))]
    return [(modules, group) for modules, group in units if group]


class ZeroShardedOptimizer(BucketedEngine):
    def __init__(self, wrapped: EngineModel, groups: EngineGroups, settings: DataParallelSettings):
        """`settings.zero` is the stage (1 or 2). `wrapped.blocks`: modules whose parameters are gathered
        as a unit each, waited for in their forward pre-hooks; the other parameters are waited for when
        one of `wrapped.roots` (default: the model) runs. `settings.param_dtype` other than fp32: the
        parameters become that compute copy, the owned rows fp32 masters of their own
        (mixed_precision.py), and the gathers move the compute dtype."""
        model, comm, blocks, roots = wrapped.model, groups.comm, wrapped.blocks, wrapped.roots
        stage, shard, replicate = settings.zero, groups.shard, groups.replicate
        if stage not in (1, 2):
            raise ValueError(f"ZeroShardedOptimizer handles stages 1 and 2, not {stage}")
        self.model, self.comm, self.shard, self.replicate, self.stage = model, comm, shard, replicate, stage
        self.shard_mesh = groups.shard_mesh
        self.norm_group = shard
        self.reduce_dtype = settings.reduce_dtype
        param_dtype, bucket_bytes = settings.param_dtype, settings.bucket_bytes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = param_dtype != torch.float32
        self.grad_dtype = torch.float32 if self.mixed else self.params[0].dtype
        # Stage 1 keeps whole gradients; where a reduce-scatter would be an all-reduce anyway (gloo),
        # all-reducing them in place skips packing them rank-major and copying the rows back.
        self.in_place = stage == 1 and replicate.size == 1 and comm.reduce_scatter_is_all_reduce(shard)
        self.buckets = [
            _ShardedBucket(b, shard, stage, self.reduce_dtype, self.in_place, self.mixed, settings.cut_within)
            for b in make_buckets(self.params, bucket_bytes, grad_bytes=4 if self.mixed else None)
        ]
        # Each parameter's owned rows: where the gathers after a step read its new values.
        self.owned_of = {id(p): o for b in self.buckets for p, o in zip(b.params, b.owned, strict=True)}
        if self.mixed:
            to_compute_dtype_(self.params, param_dtype)
        self.units = []
        for index, (modules, group) in enumerate(gather_units(model, self.params, blocks or [], roots)):
            self.units.append(_GatherUnit(group, shard, settings.cut_within))
            for module in modules:
                module.register_forward_pre_hook(lambda _m, _a, i=index: self._wait_for_unit(i))
        self.launched = len(self.units)  # units whose gather has started (none is running now)
        # Per unit reached by forward: units whose gather had started once it could compute (> its
        # index + 1 means later units' gathers ran behind its forward).
        self.gather_log: list[int] = []
        full = max(b.layout.shard_numel * shard.size for b in self.buckets)
        self.staging = Staging(max(full, *(u.full_numel for u in self.units)), self.params[0].device)
        self._watch_buckets()

    def optimizer_params(self) -> list[nn.Parameter]:
        return [owned for bucket in self.buckets for owned in bucket.owned]

    def owned_rows(self) -> list[OwnedRows]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [
            OwnedRows(
                name=names[id(p)],
                param=owned,
                start=start,
                rows=stop - start,
                shape=tuple(p.shape),
                row_shape=s.shape if s.cut_within else (),
            )
            for bucket in self.buckets
            for p, owned, (start, stop), s in zip(
                bucket.params, bucket.owned, bucket.row_ranges, bucket.layout.shapes, strict=True
            )
        ]

    def load_owned_rows(self) -> None:
        self.after_step()  # every rank loaded only its rows; gather the whole parameters again
        self.finish_params()

    def prepare_micro_batch(self, is_last: bool) -> None:
        self._collect()  # stage 2: fold the previous micro-batch's reduced rows into the accumulator
        self._start_micro_batch(sync=is_last or self.stage == 2)

    def _launch(self, bucket: _ShardedBucket) -> None:
        dtype = self.reduce_dtype
        if bucket.in_place:
            buffer = bucket.flat
            if dtype != buffer.dtype:
                bucket.send = buffer = buffer.to(dtype)
            counted = bucket.layout.shard_numel * self.shard.size
            bucket.pending = self.comm.reduce_scatter_kept_whole_async(buffer, self.shard, counted)
            return
        grads = bucket.whole_grads or [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params
        ]
        numel = bucket.layout.shard_numel * self.shard.size
        send = self.staging.take(dtype, numel)
        bucket.layout.pack(grads, send)
        if self.stage == 2:
            for p in bucket.params:
                p.grad = None  # the full gradient lives only until it is packed
        bucket.pending = self.comm.reduce_scatter_async(bucket.received, send, self.shard)
        self.staging.hold(lambda: self._wait(bucket))

    def _wait(self, bucket: _ShardedBucket) -> None:
        """Bucket's reduce-scatter done; stage 2 folds its rows into the accumulator at once."""
        if bucket.pending is None:
            return
        bucket.pending.wait()
        bucket.pending = None
        if bucket.send is not None:
            bucket.flat.copy_(bucket.send)
            bucket.send = None
        if self.stage == 2:
            bucket.grad_segment.add_(bucket.received.to(self.grad_dtype))

    def _collect(self) -> None:
        if self.stage == 2:
            for bucket in self.buckets:  # reduce-scatters only: the parameter gathers wait for forward
                self._wait(bucket)

    def finish_gradients(self) -> None:
        for bucket in self.buckets:
            if self._needs_final_launch(bucket):
                self._collect()  # stage 2: the bucket's earlier reduction first
                self._launch(bucket)
        self._collect()
        self.staging.drain()
        for bucket in self.buckets:
            if bucket.in_place:  # the whole sum, each owned row block a view of it
                self._wait(bucket)
                continue
            if self.stage == 2:
                self.comm.all_reduce_(bucket.grad_segment, self.replicate)
                continue
            reduced = self.comm.all_reduce_(bucket.received.to(self.grad_dtype), self.replicate)
            views = bucket.layout.local_views(reduced, valid_only=True)
            for i, (p, owned, rows, view, s) in enumerate(
                zip(bucket.params, bucket.owned, bucket.row_ranges, views, bucket.layout.shapes, strict=True)
            ):
                if bucket.whole_grads is None and p.grad is None:
                    p.grad = torch.zeros_like(p)
                whole = p.grad if bucket.whole_grads is None else bucket.whole_grads[i]
                owned.grad = s.rows_of(whole)[
                    slice(*rows)
                ]  # this rank's reduced rows, inside the full gradient
                owned.grad.copy_(view)

    def after_step(self) -> None:
        self.finish_params()  # a unit no forward read since the last step
        for unit in self.units:  # counted in this step, whose update the gathers carry
            self.comm.book_all_gather(unit.full_numel * unit.segment.element_size(), self.shard)
        self.launched = 0
        self.gather_log: list[int] = []
        for _ in range(2):
            self._launch_gather()

    @torch.no_grad()
    def _launch_gather(self) -> None:
        if self.launched == len(self.units):
            return
        unit = self.units[self.launched]
        self.launched += 1
        if self.mixed:  # the masters' new rows, in the compute dtype
            for p, view in zip(unit.params, unit.layout.local_views(unit.segment), strict=True):
                owned = self.owned_of[id(p)]
                view[: owned.shape[0]].copy_(owned.detach())
                view[owned.shape[0] :].zero_()
        else:
            unit.layout.pack_local([p.data for p in unit.params], unit.segment)
        unit.gathered = self.staging.take(unit.segment.dtype, unit.full_numel)
        unit.pending = self.comm.all_gather_async(unit.gathered, unit.segment, self.shard, booked=True)
        self.staging.hold(unit.finish)

    # A forward pre-hook: inside a compiled block it would be traced. (torch's lazy form of
    # torch.compiler.disable, which imports the compiler when this module loads: models/moe.py.)
    @torch._disable_dynamo
    def _wait_for_unit(self, index: int) -> None:
        """Forward reached unit `index`: its gather (and every earlier one) finished, the next launched."""
        if self.units[index].pending is None and index < self.launched:
            return
        while self.launched <= index:
            self._launch_gather()
        for unit in self.units[: index + 1]:
            unit.finish()  # in launch order, as the group runs them
        self._launch_gather()
        self.gather_log.append(self.launched)

    def finish_params(self) -> None:
        while self.launched < len(self.units):
            self._launch_gather()
        self.staging.drain()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.flat is not None:
                bucket.flat.zero_()
                continue
            if self.stage == 2:
                bucket.grad_segment.zero_()
                continue
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.zero_()

    def grad_buffers(self) -> list[torch.Tensor]:
        segments = [b.grad_segment for b in self.buckets if b.grad_segment is not None]
        return segments + ([b.flat for b in self.buckets if b.flat is not None] if self.mixed else [])
