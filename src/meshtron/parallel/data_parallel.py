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

from dataclasses import dataclass

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.schema import Config, FsdpImpl
from meshtron.engines.ddp import DistributedDataParallel
from meshtron.engines.engine import DataParallelEngine
from meshtron.engines.expert import ExpertDataParallel, ParameterSubset
from meshtron.engines.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.engines.materialize import is_meta, materialize_
from meshtron.engines.simple_fsdp import SimpleFSDP
from meshtron.engines.zero import ZeroShardedOptimizer
from meshtron.models.layers import DTYPES
from meshtron.models.llama import Transformer
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.float8 import float8_weight_names


@dataclass(frozen=True)
class DataParallelSettings:
    """The data-parallel options of a layout, as the engines take them."""

    zero: int = 3  # what dp_shard shards: 1 optimizer state, 2 + gradients, 3 + parameters
    fsdp_impl: FsdpImpl = "meshtron"  # ZeRO-3's engine
    bucket_bytes: int = 25 * 2**20  # DDP and ZeRO-1/2 gradient buckets
    param_dtype: torch.dtype = torch.float32  # the compute copy: the module's (gathered) parameters
    reduce_dtype: torch.dtype = torch.float32  # gradient reductions
    reshard_after_forward: bool = True  # ZeRO-3: free gathered units after each forward
    compiled: bool = False  # the blocks run through torch.compile (SimpleFSDP traces its gathers)
    device: torch.device = torch.device("cpu")  # where what a rank holds lives (a meta build gets it here)
    float8_all_gather: bool = False  # ZeRO-3 (meshtron's) gathers the float8 layers' weights in e4m3

    @classmethod
    def of(cls, cfg: Config, device: torch.device) -> DataParallelSettings:
        p = cfg.parallel
        return cls(
            device=device,
            zero=p.zero,
            fsdp_impl=p.fsdp_impl,
            bucket_bytes=int(p.bucket_mb * 2**20),
            param_dtype=DTYPES[cfg.training.dtype],
            reduce_dtype=DTYPES[p.reduce_dtype],
            reshard_after_forward=p.reshard_after_forward,
            compiled=cfg.training.compile,
            float8_all_gather=cfg.training.fp8_all_gather,
        )


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
    shard_dim = mesh.with_cp("dp_shard")
    blocks = list(model.layers.values())
    experts = expert_parameter_names(model) if mesh.size("ep") > 1 else frozenset()
    if not experts:
        return _engine(model, blocks, comm, mesh, settings, shard_dim, mesh.with_cp("dp"), roots)
    dense_params = ParameterSubset(model, experts, keep=False)
    dense = _engine(
        dense_params, blocks, comm, mesh, settings, shard_dim, mesh.with_cp("dp"), roots or [model]
    )
    expert_modules = [block.moe.experts for block in blocks if getattr(block, "moe", None) is not None]
    expert_params = ParameterSubset(model, experts, keep=True)
    expert_engine = _engine(expert_params, expert_modules, comm, mesh, settings, "edp", "dp_replicate")
    return ExpertDataParallel(model, dense, expert_engine, mesh.group("ep"))


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
    shard, replicate = mesh.group(shard_dim), mesh.group("dp_replicate")
    built_on_meta = is_meta(model.parameters())
    if shard.size == 1 or s.zero in (1, 2):  # whole parameters on every rank: they get their storage now
        materialize_(model.parameters(), s.device)
    if shard.size == 1:
        return DistributedDataParallel(
            model, comm, mesh.group(whole_dim), bucket_bytes=s.bucket_bytes, reduce_dtype=s.reduce_dtype,
            broadcast=not built_on_meta, param_dtype=s.param_dtype,
        )  # fmt: skip
    dtypes = {"param_dtype": s.param_dtype, "reduce_dtype": s.reduce_dtype}
    if s.zero in (1, 2):
        return ZeroShardedOptimizer(
            model, comm, shard, replicate, stage=s.zero, bucket_bytes=s.bucket_bytes,
            reduce_dtype=s.reduce_dtype, shard_mesh=mesh.mesh(shard_dim), blocks=blocks, roots=roots,
            param_dtype=s.param_dtype,
        )  # fmt: skip
    if s.fsdp_impl == "simple":
        return SimpleFSDP(
            model, [*(roots or [model]), *blocks], comm, shard, replicate, **dtypes,
            shard_mesh=mesh.mesh(shard_dim), compiled=blocks if s.compiled else None, device=s.device,
        )  # fmt: skip
    if s.fsdp_impl == "torch":
        device_mesh = mesh.world["dp_replicate", shard_dim] if replicate.size > 1 else mesh.mesh(shard_dim)
        return TorchFSDP(
            model, blocks, device_mesh, shard, **dtypes, reshard_after_forward=s.reshard_after_forward,
            device=s.device,
        )  # fmt: skip
    float8 = (
        float8_weight_names(model) if s.float8_all_gather and isinstance(model, nn.Module) else frozenset()
    )
    return FullyShardedDataParallel(
        model, blocks, comm, shard, replicate, **dtypes, reshard_after_forward=s.reshard_after_forward,
        shard_mesh=mesh.mesh(shard_dim), roots=roots, device=s.device, float8=float8,
    )  # fmt: skip
