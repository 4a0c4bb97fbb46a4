"""ZeRO-3 / FSDP with per-parameter dim-0 sharding, prefetch, mixed precision and HSDP.

Each transformer block is a unit, and so is the root (embedding, final norm, output head). A unit's
parameters live sharded: this rank keeps an fp32 row block of each (views into one flat `master`
buffer, see shard.py), which is what the optimizer updates. The module's own parameters stay registered
at full shape, but their storage is empty except while the unit runs:

  forward   pre-hook: all-gather the unit (in the compute dtype), and start gathering the next unit
            (of the same pipeline chunk) so that communication overlaps this unit's compute; post-hook:
            free the full parameters (reshard_after_forward) and hook the unit's output so backward
            can find it again
  backward  on the output's gradient: gather the unit again (prefetching the unit before it); when
            every parameter's gradient has been accumulated: reduce-scatter them (in reduce_dtype)
            into this rank's fp32 gradient shard, free the full gradients and parameters
  HSDP      with dp_replicate > 1 the gradient shards are then all-reduced across replicas
  pipeline  prefetches stay inside the chunk running; after a chunk's backward (B) its units are freed
            even where its weight gradients come later (W, split backward: `chunk_backward`)

Freeing resizes a parameter's storage to zero and gathering resizes it back, so tensors autograd saved
during forward (which share that storage) see the gathered values again in backward. Per step this moves
an all-gather in forward, one in backward and a reduce-scatter: 3Ψ(n-1)/n.

`TorchFSDP` runs PyTorch's own `fully_shard` (FSDP2) behind the same interface, for comparison.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.fsdp2_counted import count_fsdp2
from meshtron.comm.group import CommGroup
from meshtron.comm.pending import Pending
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.engines.fsdp_float8 import Float8Gather
from meshtron.engines.materialize import is_meta, materialize_, untouched_zeros
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel
from meshtron.engines.shard import FlatLayout
from meshtron.engines.staging import Staging
from meshtron.models.rerun import is_rerunning


class FSDPUnit:
    """The parameters of one module, sharded over the dp_shard group."""

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        shard: CommGroup,
        param_dtype: torch.dtype,
        device: torch.device,
        float8: list[bool] | None = None,
        cut_within: bool = True,
    ):
        """`params` on `device`, or on the meta device (built without storage: the shards start at zero
        and are filled through `owned_rows`, parallel/regions.py). `float8`: which params gather in float8
        (fsdp_float8.py); None: all in `param_dtype`. `cut_within`: how stacks of
        matrices are cut (config/row_blocks.py)."""
        self.names, self.params, self.param_dtype = names, params, param_dtype
        self.rank = shard.rank
        self.layout = FlatLayout([tuple(p.shape) for p in params], shard.size, shard.rank, cut_within)
        self.master_flat = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        if not is_meta(params):
            self.layout.pack_local([p.data for p in params], self.master_flat)
        # Padding rows have zero gradients, so AdamW leaves them at zero: they never leak into the model.
        self.master = [nn.Parameter(v) for v in self.layout.local_views(self.master_flat)]
        # Zero until the first backward writes it: resident from then, not from start-up (a parameter
        # share's worth of memory before step 1).
        self.grad_flat = untouched_zeros(self.layout.shard_numel, torch.float32, device)
        for m, g in zip(self.master, self.layout.local_views(self.grad_flat), strict=True):
            m.grad = g
        materialize_(params, device, param_dtype, empty=True)
        for p in params:
            if p.untyped_storage().nbytes():  # built with values: they live in the shards now
                p.data = torch.empty(p.shape, dtype=param_dtype, device=device)
                p.untyped_storage().resize_(0)
        self.gathering: tuple[Pending, torch.Tensor] | None = None
        self.float8 = (
            Float8Gather(params, float8, shard, param_dtype, cut_within) if float8 and any(float8) else None
        )
        self.unsharded = False
        self.ready = 0  # parameters whose gradient has been accumulated since the unit last reduced
        self.expected = len(params)  # accumulations per micro-batch (more where backward calls share one)
        self.in_backward = False  # a backward hook of this unit fired since it last reduced
        self.chunks: set[int] = set()  # the pipeline chunks whose forwards use it (0: no pipeline)
        self.reduced = False  # reduced at least once this step
        self.reducing: list[Callable[[], None]] = []  # folds of reductions in flight

    def start_gather(self, comm: Comm, shard: CommGroup, staging: Staging) -> None:
        if self.unsharded or self.gathering is not None:
            return
        if self.float8 is not None:  # bytes: float8 weights in e4m3, the rest in the compute dtype
            send = self.float8.pack(comm, shard, self.master)
            elements = -(-send.numel() * shard.size // (torch.finfo(self.param_dtype).bits // 8))
            gathered = staging.take(self.param_dtype, elements).view(torch.uint8)[: send.numel() * shard.size]
        else:
            send = self.master_flat.to(self.param_dtype)
            gathered = staging.take(self.param_dtype, send.numel() * shard.size)
        self.gathering = (comm.all_gather_async(gathered, send, shard), gathered)

        def finish() -> None:  # the buffer is needed again: this gather lands in the parameters now
            if self.gathering is not None:
                self.unshard(comm, shard, staging)

        staging.hold(finish)

    def unshard(self, comm: Comm, shard: CommGroup, staging: Staging) -> None:
        if self.unsharded:
            return
        self.start_gather(comm, shard, staging)
        pending, gathered = self.gathering
        pending.wait()
        self.gathering = None
        for p in self.params:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        # Through `.data`, so autograd's version counters (checked on saved tensors) are not bumped.
        if self.float8 is not None:
            self.float8.unpack(gathered, self.params, shard.size)
        else:
            self.layout.unpack(gathered, [p.data for p in self.params])
        self.unsharded = True

    def reshard(self) -> None:
        if self.unsharded:
            for p in self.params:
                p.untyped_storage().resize_(0)
            self.unsharded = False


def _chunk_of_modules(chunks: list[nn.Module]) -> dict[int, int]:
    """id of each module inside a pipeline chunk -> the chunk's position in `chunks`."""
    return {id(m): c for c, chunk in enumerate(chunks) for m in chunk.modules()}


def _activations(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's (possibly nested tuple) output that are activations, not scalars."""
    if isinstance(output, tuple):
        return [t for part in output for t in _activations(part)]
    return [output] if isinstance(output, torch.Tensor) and output.ndim >= 2 else []


class FullyShardedDataParallel(DataParallelEngine):
    def __init__(self, wrapped: EngineModel, groups: EngineGroups, settings: DataParallelSettings):
        """One unit per block and one for the parameters outside them, gathered when one of
        `wrapped.root_modules` runs (two on the first rank of a V schedule: each gathers the root unit
        before it runs). `settings.device`: where the shards live (a model built on the meta device
        gets them there). `wrapped.float8`: the parameters to gather in float8 (fsdp_float8.py)."""
        model, comm, blocks, float8 = wrapped.model, groups.comm, wrapped.blocks, wrapped.float8
        shard, param_dtype, device = groups.shard, settings.param_dtype, settings.device
        self.model, self.comm, self.shard, self.replicate = model, comm, shard, groups.replicate
        self.shard_mesh = groups.shard_mesh
        self.norm_group = shard
        self.reduce_dtype = settings.reduce_dtype
        self.reshard_after_forward = settings.reshard_after_forward
        block_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
        # Forward order: the root gathers first (the embedding runs first) and blocks follow.
        named: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(blocks) + 1)]
        for name, p in model.named_parameters():
            named[block_of.get(id(p), -1) + 1].append((name, p))
        # A middle pipeline stage has no root parameters, and so no root unit.
        hooked = [wrapped.root_modules, *([b] for b in blocks)]
        modules = [(mods, group) for mods, group in zip(hooked, named, strict=True) if group]
        self.has_root = bool(named[0])
        self.units = [
            FSDPUnit(
                [n for n, _ in group],
                [p for _, p in group],
                shard,
                param_dtype,
                device,
                [n in float8 for n, _ in group],
                settings.cut_within,
            )
            for _, group in modules
        ]
        # Gathered units and reduce-scatter inputs (with the received shard after it) in two persistent
        # buffers each, of the largest block (staging.py; the root unit, often larger, gets its own).
        blocks_only = self.units[1:] if self.has_root and len(self.units) > 1 else self.units
        largest = max(u.layout.shard_numel for u in blocks_only)
        self.gathers = Staging(largest * shard.size, device)
        self.reductions = Staging(largest * (shard.size + 1), device)
        # The gradient hooks hold the engine weakly: autograd keeps a parameter's hooks where the garbage
        # collector cannot follow them, so a strong reference kept the engine, the model and their process
        # groups (with their threads) alive after the trainer was gone.
        engine = weakref.proxy(self)
        chunk_of = _chunk_of_modules(wrapped.chunks)
        self.chunk_index = {id(chunk): c for c, chunk in enumerate(wrapped.chunks)}
        self.holding: int | None = None  # the chunk whose split B is running (`chunk_backward`)
        self.root_chunks: set[int] = set()
        # Each chunk's blocks, by unit index in forward order: prefetches stay inside the chunk running
        # (the next chunk of a rank runs after other ranks' work, maybe another micro-batch's first).
        self.chunk_blocks: dict[int, list[int]] = {}
        for index, ((mods, _), unit) in enumerate(zip(modules, self.units, strict=True)):
            for module in mods:
                chunk = chunk_of.get(id(module), 0)
                unit.chunks.add(chunk)
                if index or not self.has_root:
                    self.chunk_blocks.setdefault(chunk, []).append(index)
                else:
                    self.root_chunks.add(chunk)
                module.register_forward_pre_hook(lambda _m, _a, i=index, c=chunk: self._pre_forward(i, c))
                module.register_forward_hook(
                    lambda _m, _a, out, i=index, c=chunk: self._post_forward(i, c, out)
                )
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda _p, i=index, e=engine: e._on_grad_ready(i))

    def _next_in_forward(self, index: int, chunk: int) -> FSDPUnit | None:
        """After the root, the chunk's first block; after a block, the chunk's next."""
        later = [i for i in self.chunk_blocks.get(chunk, []) if i > index]
        return self.units[later[0]] if later else None

    def _next_in_backward(self, index: int, chunk: int) -> FSDPUnit | None:
        """After the root (the head's gradient comes first), the chunk's last block; after a block, the
        chunk's previous one (the first block's is the root, gathered already, or none)."""
        blocks = self.chunk_blocks.get(chunk, [])
        earlier = blocks if self.has_root and index == 0 else [i for i in blocks if i < index]
        return self.units[earlier[-1]] if earlier else None

    def _pre_forward(self, index: int, chunk: int) -> None:
        self.units[index].unshard(self.comm, self.shard, self.gathers)
        # A recompute's rerun (a unit inside a recomputed block: an MoE layer's experts) runs in backward,
        # after the units that follow it in forward have reduced: prefetching one would be thrown away.
        following = None if is_rerunning() else self._next_in_forward(index, chunk)
        if following is not None:
            following.start_gather(self.comm, self.shard, self.gathers)

    def _post_forward(self, index: int, chunk: int, output: Any) -> None:
        # Each activation output (an MTP module returns two, a root with MTP several logits), whichever
        # backward reaches first; not a scalar aux loss, whose gradient comes as soon as backward starts.
        for out in _activations(output):
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda grad, i=index, c=chunk: self._pre_backward(i, c, grad))
        # (A rerun's unit stays gathered: its backward follows at once.)
        if (self.reshard_after_forward and not is_rerunning()) or not torch.is_grad_enabled():
            self.units[index].reshard()

    def _pre_backward(self, index: int, chunk: int, grad: torch.Tensor) -> torch.Tensor:
        unit = self.units[index]
        unit.unshard(self.comm, self.shard, self.gathers)
        # Only the first of a unit's outputs to get its gradient prefetches: a root with MTP heads has
        # several, and a later one would gather again a unit that has already reduced and resharded.
        following = None if unit.in_backward else self._next_in_backward(index, chunk)
        unit.in_backward = True
        if following is not None:
            following.start_gather(self.comm, self.shard, self.gathers)
        return grad

    @contextlib.contextmanager
    def chunk_backward(self, chunk: nn.Module, defers_weights: bool) -> Iterator[None]:
        """Afterwards free the chunk's units (the root with a chunk holding it): under a split backward
        they would stay gathered until their weight gradients (W) reduce them, maybe after other
        micro-batches' B, and a chunk's every unit could be whole at once. Meanwhile a split B reduces
        without resharding: a unit whose gradient count completes while its B runs (its norms' from
        this micro-batch, its linear layers' from an earlier one's W) still computes input gradients."""
        position = self.chunk_index[id(chunk)]
        self.holding = position if defers_weights else None
        try:
            yield
        finally:
            self.holding = None
            root = [0] if self.has_root and position in self.root_chunks else []
            for index in [*root, *self.chunk_blocks.get(position, [])]:
                self.units[index].reshard()
                self.units[index].in_backward = False

    def expect_grad_uses(self, param: nn.Parameter, uses: int) -> None:
        for unit in self.units:
            if any(p is param for p in unit.params):
                unit.expected += uses - 1

    def _on_grad_ready(self, index: int) -> None:
        unit = self.units[index]
        unit.ready += 1
        if unit.ready == unit.expected:
            unit.ready, unit.reduced = 0, True
            self._reduce(unit)

    def _reduce(self, unit: FSDPUnit) -> None:
        device = unit.master_flat.device
        grads = [p.grad if p.grad is not None else torch.zeros(p.shape, device=device) for p in unit.params]
        full = unit.layout.shard_numel * self.shard.size
        buffer = self.reductions.take(self.reduce_dtype, full + unit.layout.shard_numel)
        send, received = buffer[:full], buffer[full:]
        unit.layout.pack(grads, send)
        for p in unit.params:
            p.grad = None
        if self.holding not in unit.chunks:  # (else the running B still needs it: chunk_backward)
            unit.reshard()
            unit.in_backward = False
        pending: list[Pending] = [self.comm.reduce_scatter_async(received, send, self.shard)]

        def fold() -> None:  # the reduced shard into the accumulator, once (the buffer is free after)
            if pending:
                pending.pop().wait()
                unit.grad_flat.add_(received.to(unit.grad_flat.dtype))

        unit.reducing.append(fold)
        self.reductions.hold(fold)

    def _collect(self) -> None:
        for unit in self.units:
            for fold in unit.reducing:
                fold()
            unit.reducing.clear()

    def optimizer_params(self) -> list[nn.Parameter]:
        return [m for unit in self.units for m in unit.master]

    def owned_rows(self) -> list[OwnedRows]:
        return [
            OwnedRows(
                name=name,
                param=m,
                start=s.row_range(unit.rank)[0],
                rows=s.valid_rows(unit.rank),
                shape=s.logical,
                row_shape=s.shape if s.cut_within else (),
            )
            for unit in self.units
            for name, m, s in zip(unit.names, unit.master, unit.layout.shapes, strict=True)
        ]

    def prepare_micro_batch(self, is_last: bool) -> None:
        self._collect()  # every micro-batch is reduced as its backward goes; fold in the previous one

    def finish_gradients(self) -> None:
        for unit in self.units:
            if unit.ready > 0 or not unit.reduced:  # some parameter got no gradient: reduce what there is
                self._reduce(unit)
            unit.ready, unit.reduced = 0, False
            unit.reshard()
            if unit.gathering is not None:  # a prefetch nothing used: it holds pre-step values
                unit.gathering[0].wait()
                unit.gathering = None
        self._collect()
        for unit in self.units:
            self.comm.all_reduce_(unit.grad_flat, self.replicate)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_flat.zero_()

    def grad_buffers(self) -> list[torch.Tensor]:
        return [unit.grad_flat for unit in self.units]


class TorchFSDP(DataParallelEngine):
    """PyTorch's `fully_shard` (FSDP2) on the same units, for comparison. Its all-gathers and reduce-
    scatters are issued through FSDP2's custom-collective hooks so that comm_bytes counts them, and its
    HSDP all-reduce is booked after the fact (comm/fsdp2_counted.py)."""

    def __init__(self, wrapped: EngineModel, groups: EngineGroups, settings: DataParallelSettings):
        """`groups.shard_mesh`: the DeviceMesh fully_shard shards over (2-D for HSDP), one unit per block
        of `wrapped.blocks` and the model's own.
        `settings.device`: where a model built on the meta device gets its shards (fully_shard first
        shards the meta parameters, then they get storage: FSDP2's meta-device flow)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model, blocks = wrapped.model, wrapped.blocks
        device_mesh, reshard_after_forward = groups.shard_mesh, settings.reshard_after_forward
        self.model, self.norm_group, self.shard_mesh = model, groups.shard, device_mesh
        policy = MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
        # Its mesh is 2-D under HSDP (dp_replicate x dp_shard): then it all-reduces across replicas.
        replicas = groups.replicate if device_mesh.ndim > 1 else None
        # Tensor parallel's gradient sums over tp (whole weights that see 1/tp of the tokens under sp:
        # parallel/tensor.py) hang on parameters that fully_shard replaces with its own: finish_gradients
        # applies them to the reduced shards (a sum over tp commutes with FSDP2's over dp).
        self.tp_sums = {
            n: p.grad_hooks for n, p in model.named_parameters() if getattr(p, "grad_hooks", None)
        }
        for module in [*blocks, model]:
            fully_shard(
                module, mesh=device_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward
            )
            # Our loss is already divided by the global token count: sum the gradients, do not average
            # (a plain SUM: gloo has neither AVG nor PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            count_fsdp2(module, groups.comm, groups.shard, replicas)
        if is_meta(model.parameters()):
            model.to_empty(device=settings.device)  # the buffers too: parallelize resets them after this step

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def owned_rows(self) -> list[OwnedRows]:
        # The parameters are DTensors already: they carry their own placement into checkpoints.
        return [
            OwnedRows(name=name, param=p, start=0, rows=p.shape[0], shape=tuple(p.shape))
            for name, p in self.model.named_parameters()
        ]

    def local_grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]

    def scale_grads_(self, coef: torch.Tensor) -> None:
        for g in self.local_grads():
            g.mul_(coef.to(g.dtype))

    def prepare_micro_batch(self, is_last: bool) -> None:
        # FSDP2 reduce-scatters every micro-batch, as ours does. Under HSDP it would all-reduce each
        # micro-batch's shards across replicas too; told which is the last, it sums the earlier shards
        # locally and all-reduces once per step, as ours does (a no-op without replicas). The root's call
        # sets every unit inside it.
        self.model.set_requires_all_reduce(is_last)

    def finish_gradients(self) -> None:
        # FSDP2 waited for its reductions at the end of backward; the tp sums run once per step, on the
        # accumulated shards.
        for name, p in self.model.named_parameters():
            if name in self.tp_sums and p.grad is not None:
                local = p.grad.to_local()
                for hook in self.tp_sums[name]:
                    local.copy_(hook(local))

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None
