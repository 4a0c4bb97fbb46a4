"""SimpleFSDP: ZeRO-3 written as a parametrization (Zhang et al. 2024, "SimpleFSDP: Simpler Fully Sharded
Data Parallel with torch.compile").

Instead of hooks that gather a whole unit before it runs (fsdp.py), every parameter is stored as this
rank's dim-0 row block, and reading it from its module all-gathers it through a differentiable function:

  module.weight      a class property (the module's class is swapped for a subclass that has one): the
                     stored row block -> cast to the compute dtype -> all-gather -> the logical tensor
  its gradient       autograd runs the gather's backward: pad -> cast to reduce_dtype -> reduce-scatter ->
                     this rank's rows, accumulated into the row block's `.grad` like any leaf's
  backward's copy    a gathered weight an operator saves for backward is not kept: a saved-tensor hook
                     stores a handle instead and gathers it again when backward unpacks it (the paper's
                     recompute policy on the all-gather), so memory is ZeRO-3's
  HSDP               with dp_replicate > 1 the reduced row blocks are all-reduced across replicas

Parameter names, `state_dict` and the optimizer's tensors are the row blocks under the model's own
names, so checkpoints hold the same rectangles as meshtron's FSDP and reshard with every layout. Per
micro-batch this moves an all-gather of each parameter in forward, one in backward for each parameter an
operator saved (every weight but the embedding table, whose gradient needs only the output's), and a
reduce-scatter: (3Ψ - Ψ_embedding)(n-1)/n, plus what reads beyond one add (a tied head's of the table,
each multi-token prediction depth's lookup and head call; plan/comm.py `_simple_fsdp_reads`, exact).
Every read gathers, even of a shape: model code takes sizes from plain ints (MoE.local_experts, the
vocabulary shard's rows), where reading `experts.w1.shape` once gathered the stack a third time.

Compiled (`training.compile`): a parameter read while torch.compile traces takes another path, the one
the design is for. The gather goes through functional collectives (comm.gather_rows_traced), inside a
selective checkpoint that marks it always-recompute, so the whole of it (cast, all-gather, reduce-scatter
in backward) lands in the block's graph and the partitioner regathers rather than saves. Inductor's
passes (parallel/compile.py) then bucket a block's gathers into one all-gather per pass and its gradients into
one reduce-scatter. Nothing counts calls inside a graph, so the engine books those bytes per micro-batch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.saved_gathers import SAVED_GATHERS
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel
from meshtron.engines.shard import ShardedShape


class _Gather(torch.autograd.Function):
    """Row block [rows, *rest] -> logical tensor [d0, *rest] in `spec.param_dtype`; backward
    reduce-scatters the gradient (in `spec.reduce_dtype`) back to the row block."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, spec: ShardedParam) -> torch.Tensor:
        ctx.spec = spec
        return spec.gather(block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        spec: ShardedParam = ctx.spec
        rows = spec.shape.rows * spec.group.size
        padded = grad.new_zeros((rows, *spec.shape.shape[1:]), dtype=spec.reduce_dtype)
        padded[: spec.shape.shape[0]] = grad.reshape(spec.shape.shape)
        block = spec.comm.reduce_scatter_tensor(padded, spec.group, consume=True)
        return block.to(spec.block.dtype), None


class ShardedParam:
    """One logical parameter stored as this rank's row block over `group`."""

    def __init__(
        self,
        name: str,
        block: nn.Parameter,
        shape: ShardedShape,
        comm: Comm,
        group: CommGroup,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ):
        self.name, self.block, self.shape = name, block, shape
        self.comm, self.group = comm, group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """The logical tensor (a view of the padded all-gather result), no autograd."""
        padded = self.comm.all_gather_tensor(block.detach().to(self.param_dtype), self.group)
        return padded[: self.shape.shape[0]].view(self.shape.logical)

    def gather_traced(self, block: torch.Tensor) -> torch.Tensor:
        """The logical tensor through functional collectives a compiler traces (autograd included)."""
        padded = self.comm.gather_rows_traced(block.to(self.param_dtype), self.group, self.reduce_dtype)
        return padded[: self.shape.shape[0]].view(self.shape.logical)

    def full_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the padded logical tensor in `dtype`: what one gather or reduce-scatter moves."""
        return self.shape.shard_numel * self.group.size * dtype.itemsize


def _recompute_all(_ctx: Any, _op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


# Compiled: a gather (cast, all-gather, slice) is never saved for backward; the compiler's partitioner
# reruns it where backward needs the weight (the paper's policy, as a selective checkpoint).
_GATHER_RECOMPUTED = functools.partial(create_selective_checkpoint_contexts, _recompute_all)


def _parametrize(module: nn.Module, specs: dict[str, ShardedParam]) -> None:
    """Swap `module`'s class for a subclass whose parameters in `specs` are properties that gather."""

    def getter(name: str) -> property:
        def read(self: nn.Module) -> torch.Tensor:
            spec = specs[name]
            if torch.compiler.is_compiling():
                block = self._parameters[name]
                return checkpoint(
                    spec.gather_traced, block, use_reentrant=False, context_fn=_GATHER_RECOMPUTED
                )
            gathered = _Gather.apply(self._parameters[name], spec)
            if torch.is_grad_enabled():
                SAVED_GATHERS.track(gathered, self._parameters[name], spec.gather)
            return gathered

        return property(read)

    cls = module.__class__
    module.__class__ = type(f"SimpleFSDP{cls.__name__}", (cls,), {n: getter(n) for n in specs})


class SimpleFSDP(DataParallelEngine):
    """ZeRO-3 over `shard` (HSDP across `replicate`) as a parametrization of every parameter."""

    def __init__(self, wrapped: EngineModel, groups: EngineGroups, settings: DataParallelSettings):
        """The saved-tensor hooks are active inside the modules whose forwards save gathered weights for
        backward: the blocks and the root modules (which run the embedding and the head). With
        `settings.compiled` the blocks' forwards run compiled; their parameters take the traced path,
        whose bytes are booked per micro-batch (a gather in forward, one in backward, a reduce-scatter).
        `settings.device`: where the shards live (a meta-device build gets them there)."""
        model, comm, blocks = wrapped.model, groups.comm, wrapped.blocks
        hooked, compiled = [*wrapped.root_modules, *blocks], blocks if settings.compiled else []
        shard, param_dtype, reduce_dtype = groups.shard, settings.param_dtype, settings.reduce_dtype
        self.model, self.comm, self.shard, self.replicate = model, comm, shard, groups.replicate
        self.device, self.cut_within = settings.device, settings.cut_within
        self.shard_mesh, self.norm_group = groups.shard_mesh, shard
        self.specs: dict[int, ShardedParam] = {}  # id of the original parameter -> its sharded form
        for module_name, module in model.named_modules():
            own = {n: p for n, p in module._parameters.items() if p is not None}
            if not own:
                continue
            specs = {}
            for n, p in own.items():
                if id(p) not in self.specs:  # a tied weight is sharded once, read through both modules
                    name = f"{module_name}.{n}" if module_name else n
                    self.specs[id(p)] = self._shard(name, p, param_dtype, reduce_dtype)
                specs[n] = self.specs[id(p)]
                module._parameters[n] = specs[n].block
            _parametrize(module, specs)
        inside = {id(p) for m in compiled for p in m.parameters()}
        self.traced = [s for s in self.specs.values() if id(s.block) in inside]
        for module in hooked:
            SAVED_GATHERS.hook(module)

    def _shard(
        self, name: str, p: nn.Parameter, param_dtype: torch.dtype, reduce_dtype: torch.dtype
    ) -> ShardedParam:
        shape = ShardedShape.of(tuple(p.shape), self.shard.size, self.cut_within)
        start, stop = shape.row_range(self.shard.rank)
        block = torch.zeros((shape.rows, *shape.shape[1:]), dtype=torch.float32, device=self.device)
        if not p.is_meta:  # built without values: filled through owned_rows (parallel/regions.py)
            block[: stop - start] = shape.rows_of(p.detach())[start:stop]
        block = nn.Parameter(block)
        # The gradient's row block, kept across steps (autograd accumulates into it in place).
        block.grad = torch.zeros_like(block)
        for hook in getattr(
            p, "grad_hooks", []
        ):  # e.g. tensor parallel's sum over tp (row-wise, so the same)
            block.register_hook(hook)
        # Padding rows have zero gradients, so AdamW leaves them at zero: they never leak into the model.
        return ShardedParam(name, block, shape, self.comm, self.shard, param_dtype, reduce_dtype)

    def optimizer_params(self) -> list[nn.Parameter]:
        return [spec.block for spec in self.specs.values()]

    def owned_rows(self) -> list[OwnedRows]:
        rank = self.shard.rank
        return [
            OwnedRows(
                name=s.name,
                param=s.block,
                start=s.shape.row_range(rank)[0],
                rows=s.shape.valid_rows(rank),
                shape=s.shape.logical,
                row_shape=s.shape.shape if s.shape.cut_within else (),
            )
            for s in self.specs.values()
        ]

    def prepare_micro_batch(self, is_last: bool) -> None:
        # Every micro-batch's backward reduce-scatters as it goes, into the blocks' .grad; the traced
        # collectives of the compiled modules are counted here, since nothing counts inside a graph.
        for spec in self.traced:
            for _ in range(2):
                self.comm.book("all_gather", spec.full_nbytes(spec.param_dtype), self.shard)
            self.comm.book("reduce_scatter", spec.full_nbytes(spec.reduce_dtype), self.shard)

    def finish_gradients(self) -> None:
        if self.replicate.size == 1:
            return
        blocks = [s.block for s in self.specs.values()]
        # One all-reduce of every row block's gradient across the replicas.
        flat = self.comm.all_reduce_(torch.cat([b.grad.flatten() for b in blocks]), self.replicate)
        for block, part in zip(blocks, flat.split([b.numel() for b in blocks]), strict=True):
            block.grad.copy_(part.view_as(block))

    def zero_grad(self) -> None:
        for spec in self.specs.values():
            spec.block.grad.zero_()
