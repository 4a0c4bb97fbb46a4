"""The data-parallel step of `parallelize`: which engine replicates or shards this rank's model.

Context-parallel ranks hold the same parameters and different tokens, so they join the data-parallel
ranks in every gradient reduction, and sharding runs over dp_shard x cp (as torchtitan does):

  dp_shard·cp = 1                 DDP over dp_replicate (a group of size 1 costs nothing)      engines/ddp.py
  dp_shard·cp > 1, zero = 1 or 2  ZeRO-1/2 over dp_shard·cp, all-reduce across dp_replicate   engines/zero.py
  dp_shard·cp > 1, zero = 3       meshtron's FSDP (HSDP with dp_replicate > 1)                engines/fsdp.py
                                  or PyTorch's fully_shard with fsdp_impl = "torch"
                                  or SimpleFSDP (a parametrization) with fsdp_impl = "simple"  engines/simple_fsdp.py

With expert parallel (ep > 1) the experts' weights get a second engine of the same kind over their
expert-data-parallel group edp (DDP over dp_replicate when edp = 1); engines/expert.py.

Under pipeline parallel the same engines run per stage: FSDP's root unit (embedding, final norm, head)
is the stage's chunk that holds them, and a middle stage has none.
"""

from __future__ import annotations

from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import Dim
from meshtron.engines.ddp import DistributedDataParallel
from meshtron.engines.engine import DataParallelEngine
from meshtron.engines.expert import ExpertDataParallel, ParameterSubset
from meshtron.engines.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.engines.materialize import is_meta, materialize_
from meshtron.engines.settings import DataParallelSettings, EngineGroups
from meshtron.engines.simple_fsdp import SimpleFSDP
from meshtron.engines.zero import ZeroShardedOptimizer
from meshtron.models.llama import Transformer
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.float8 import float8_weight_names


def apply_data_parallel(
    model: Transformer,
    comm: Comm,
    mesh: ParallelMesh,
    settings: DataParallelSettings,
    roots: list[nn.Module] | None = None,
) -> DataParallelEngine:
    """The data-parallel step of `parallelize`: the engine for this layout over `model` (already cut by
    the earlier steps). `roots`: the modules whose forwards use the parameters outside the blocks, when it
    is not the model (a pipeline stage's chunks that hold the embedding or the head). With expert
    parallel, the experts get an engine of their own over edp (engines/expert.py)."""
    shard_dim = mesh.with_cp(Dim.DP_SHARD)
    blocks = list(model.layers.values())
    experts = expert_parameter_names(model) if mesh.size(Dim.EP) > 1 else frozenset()
    if not experts:
        return _engine(model, blocks, comm, mesh, settings, shard_dim, mesh.with_cp(Dim.DP), roots)
    dense_params = ParameterSubset(model, experts, keep=False)
    dense = _engine(
        dense_params, blocks, comm, mesh, settings, shard_dim, mesh.with_cp(Dim.DP), roots or [model]
    )
    expert_modules = [block.moe.experts for block in blocks if getattr(block, "moe", None) is not None]
    expert_params = ParameterSubset(model, experts, keep=True)
    expert_engine = _engine(expert_params, expert_modules, comm, mesh, settings, Dim.EDP, Dim.DP_REPLICATE)
    return ExpertDataParallel(model, dense, expert_engine, mesh.group(Dim.EP))


def _engine(
    model: nn.Module | ParameterSubset,
    blocks: list[nn.Module],
    comm: Comm,
    mesh: ParallelMesh,
    settings: DataParallelSettings,
    shard_dim: str,
    whole_dim: str,
    roots: list[nn.Module] | None = None,
) -> DataParallelEngine:
    """The engine of the table above for `model`'s parameters: sharded over `shard_dim` (all-reduced
    across dp_replicate), or, when that group has one rank, DDP over `whole_dim`."""
    s = settings
    shard, replicate = mesh.group(shard_dim), mesh.group(Dim.DP_REPLICATE)
    built_on_meta = is_meta(model.parameters())
    if shard.size == 1 or s.zero in (1, 2):  # whole parameters on every rank: they get their storage now
        materialize_(model.parameters(), s.device)
    if shard.size == 1:
        whole = EngineGroups(shard=shard, replicate=mesh.group(whole_dim))
        return DistributedDataParallel(
            model, comm=comm, groups=whole, settings=s, broadcast=not built_on_meta
        )
    groups = EngineGroups(shard=shard, replicate=replicate, shard_mesh=mesh.mesh(shard_dim))
    if s.zero in (1, 2):
        return ZeroShardedOptimizer(model, comm=comm, groups=groups, settings=s, blocks=blocks, roots=roots)
    if s.fsdp_impl == "simple":
        hooked = [*(roots or [model]), *blocks]
        compiled = blocks if s.compiled else None
        return SimpleFSDP(model, comm=comm, groups=groups, settings=s, hooked=hooked, compiled=compiled)
    if s.fsdp_impl == "torch":
        device_mesh = mesh.world[Dim.DP_REPLICATE, shard_dim] if replicate.size > 1 else mesh.mesh(shard_dim)
        torch_groups = EngineGroups(shard=shard, replicate=replicate, shard_mesh=device_mesh)
        return TorchFSDP(model, groups=torch_groups, settings=s, blocks=blocks)
    float8 = (
        float8_weight_names(model) if s.float8_all_gather and isinstance(model, nn.Module) else frozenset()
    )
    return FullyShardedDataParallel(
        model, comm=comm, groups=groups, settings=s, blocks=blocks, roots=roots, float8=float8
    )
