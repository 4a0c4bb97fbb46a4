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

from dataclasses import replace

from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import Dim
from meshtron.engines.ddp import DistributedDataParallel
from meshtron.engines.engine import DataParallelEngine
from meshtron.engines.expert import ExpertDataParallel, ParameterSubset
from meshtron.engines.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.engines.materialize import is_meta, materialize_
from meshtron.engines.settings import DataParallelSettings, EngineGroups, EngineModel
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
    chunks: list[nn.Module] | None = None,
) -> DataParallelEngine:
    """The data-parallel step of `parallelize`: the engine for this layout over `model` (already cut by
    the earlier steps). `roots`: the modules whose forwards use the parameters outside the blocks, when it
    is not the model (a pipeline stage's chunks that hold the embedding or the head); `chunks`: all the
    stage's chunks, in order (ZeRO-3 prefetches within the one running). With expert parallel, the experts get an engine of their own over edp (engines/expert.py)."""
    shard_dim, whole_dim = mesh.with_cp(Dim.DP_SHARD), mesh.with_cp(Dim.DP)
    # One unit (ZeRO-1/2/3) per block, an MTP depth's norms and projection with its block.
    blocks = [*model.layers.values(), *(model.mtp.values() if model.mtp is not None else ())]
    chunks = chunks or []
    experts = expert_parameter_names(model) if mesh.dims.experts_apart else frozenset()
    if not experts:
        whole = EngineModel(model=model, blocks=blocks, roots=roots, chunks=chunks)
        return _engine(whole, comm, mesh, settings, shard_dim, whole_dim)
    dense_params = EngineModel(
        model=ParameterSubset(model, experts, keep=False),
        blocks=blocks,
        roots=roots or [model],
        chunks=chunks,
    )
    dense = _engine(dense_params, comm, mesh, settings, shard_dim, whole_dim)
    expert_modules = [block.moe.experts for _, block in model.blocks() if block.moe is not None]
    expert_params = EngineModel(
        model=ParameterSubset(model, experts, keep=True), blocks=expert_modules, chunks=chunks
    )
    expert_engine = _engine(expert_params, comm, mesh, settings, Dim.EDP, Dim.DP_REPLICATE)
    return ExpertDataParallel(model, dense, expert_engine, mesh.group(Dim.EP))


def _engine(
    wrapped: EngineModel,
    comm: Comm,
    mesh: ParallelMesh,
    settings: DataParallelSettings,
    shard_dim: Dim,
    whole_dim: Dim,
) -> DataParallelEngine:
    """The engine of the table above for `wrapped`'s parameters: sharded over `shard_dim` (all-reduced
    across dp_replicate), or, when that group has one rank, DDP over `whole_dim`."""
    s, model = settings, wrapped.model
    shard, replicate = mesh.group(shard_dim), mesh.group(Dim.DP_REPLICATE)
    if s.replicas_apart:  # DiLoCo: each replica reduces within itself only (train/diloco.py)
        replicate = CommGroup(Dim.DP_REPLICATE, (mesh.rank,), None)
    wrapped = replace(wrapped, identical_replicas=is_meta(model.parameters()))
    if shard.size == 1 or s.zero in (1, 2):  # whole parameters on every rank: they get their storage now
        materialize_(model.parameters(), s.device)
    if shard.size == 1:
        whole = shard if s.replicas_apart else mesh.group(whole_dim)
        return DistributedDataParallel(wrapped, EngineGroups(comm=comm, shard=shard, replicate=whole), s)
    groups = EngineGroups(comm=comm, shard=shard, replicate=replicate, shard_mesh=mesh.mesh(shard_dim))
    if s.zero in (1, 2):
        return ZeroShardedOptimizer(wrapped, groups, s)
    if s.fsdp_impl == "simple":
        return SimpleFSDP(wrapped, groups, s)
    if s.fsdp_impl == "torch":
        device_mesh = mesh.world[Dim.DP_REPLICATE, shard_dim] if replicate.size > 1 else mesh.mesh(shard_dim)
        return TorchFSDP(wrapped, replace(groups, shard_mesh=device_mesh), s)
    if s.float8_all_gather and isinstance(model, nn.Module):
        wrapped = replace(wrapped, float8=float8_weight_names(model))
    return FullyShardedDataParallel(wrapped, groups, s)
