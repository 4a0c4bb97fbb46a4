"""The data-parallel step of `parallelize`: which engine replicates or shards this rank's model.

Context-parallel ranks hold the same parameters and different tokens, so they join the data-parallel
ranks in every gradient reduction, and sharding runs over dp_shard x cp (as torchtitan does):

  dp_shard·cp = 1                 DDP over dp_replicate (a group of size 1 costs nothing)      ddp.py
  dp_shard·cp > 1, zero = 1 or 2  ZeRO-1/2 over dp_shard·cp, all-reduce across dp_replicate   zero.py
  dp_shard·cp > 1, zero = 3       meshtron's FSDP (HSDP with dp_replicate > 1)                fsdp.py
                                  or PyTorch's fully_shard with fsdp_impl = "torch"
                                  or SimpleFSDP (a parametrization) with fsdp_impl = "simple"  simple_fsdp.py

With expert parallel (ep > 1) the experts' weights get a second engine of the same kind over their
expert-data-parallel group edp (DDP over dp_replicate when edp = 1); expert_data_parallel.py.

Under pipeline parallel the same engines run per stage: FSDP's root unit (embedding, final norm, head)
is the stage's chunk that holds them, and a middle stage has none.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from meshtron.comm import Comm
from meshtron.config import Config, refuse
from meshtron.mesh import ParallelMesh, resolve_dp_shard
from meshtron.models.llama import Transformer
from meshtron.parallel.ddp import DistributedDataParallel
from meshtron.parallel.engine import DataParallelEngine
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.expert_data_parallel import ExpertDataParallel, ParameterSubset
from meshtron.parallel.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.parallel.simple_fsdp import SimpleFSDP
from meshtron.parallel.zero import ZeroShardedOptimizer

DTYPES = types.MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16})


def uses_torch_fsdp(cfg: Config, world_size: int) -> bool:
    """Whether PyTorch's fully_shard shards the model (ZeRO-3 over dp_shard·cp > 1, fsdp_impl="torch")."""
    p = cfg.parallel
    return resolve_dp_shard(p, world_size) * p.cp > 1 and p.zero == 3 and p.fsdp_impl == "torch"


# Schedules whose split backward computes weight gradients outside the autograd graph of the gather.
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


def data_parallel_unsupported(cfg: Config, world_size: int) -> list[str]:
    """The engine choices this version cannot run yet."""
    p = cfg.parallel
    if uses_torch_fsdp(cfg, world_size) and p.pp > 1:
        return [
            "PyTorch's fully_shard is not wired into the pipeline runtime; use parallel.fsdp_impl='meshtron' "
            "with parallel.pp > 1"
        ]
    if p.fsdp_impl != "simple":
        return []
    problems = []
    if p.zero != 3:
        problems.append(
            f"parallel.fsdp_impl='simple' is ZeRO-3 (parameters sharded); set parallel.zero=3, not {p.zero}"
        )
    if p.ep > 1:
        problems.append(
            "parallel.fsdp_impl='simple' does not shard expert-parallel experts yet; use 'meshtron' with ep > 1"
        )
    if p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD:
        problems.append(
            f"parallel.fsdp_impl='simple' with pp_schedule={p.pp_schedule!r}: a split backward computes weight "
            "gradients outside the gather's autograd; use gpipe, 1f1b or interleaved, or fsdp_impl='meshtron'"
        )
    return problems


def apply_data_parallel(
    model: Transformer, comm: Comm, mesh: ParallelMesh, cfg: Config, roots: list[nn.Module] | None = None
) -> DataParallelEngine:
    """The engine for this layout over `model` (already cut by the earlier steps). `roots`: the modules
    whose forwards use the parameters outside the blocks, when it is not the model (a pipeline stage's
    chunks that hold the embedding or the head).
    With expert parallel, the experts get an engine of their own over edp (expert_data_parallel.py)."""
    refuse(data_parallel_unsupported(cfg, mesh.dims.world_size))
    shard_dim = mesh.with_cp("dp_shard")
    blocks = list(model.layers.values())
    experts = expert_parameter_names(model) if mesh.size("ep") > 1 else frozenset()
    if not experts:
        return _engine(model, blocks, comm, cfg, mesh, shard_dim, mesh.with_cp("dp"), roots)
    dense = _engine(
        ParameterSubset(model, experts, keep=False),
        blocks,
        comm,
        cfg,
        mesh,
        shard_dim,
        mesh.with_cp("dp"),
        roots or [model],
    )
    expert_modules = [block.moe.experts for block in blocks if getattr(block, "moe", None) is not None]
    expert_engine = _engine(
        ParameterSubset(model, experts, keep=True), expert_modules, comm, cfg, mesh, "edp", "dp_replicate"
    )
    return ExpertDataParallel(model, dense, expert_engine, mesh.group("ep"))


def _engine(
    model: nn.Module | ParameterSubset,
    blocks: list[nn.Module],
    comm: Comm,
    cfg: Config,
    mesh: ParallelMesh,
    shard_dim: str,
    whole_dim: str,
    roots: list[nn.Module] | None = None,
) -> DataParallelEngine:
    """The engine of the table above for `model`'s parameters: sharded over `shard_dim` (all-reduced
    across dp_replicate), or, when that group has one rank, DDP over `whole_dim`."""
    p, dtype = cfg.parallel, DTYPES[cfg.training.dtype]
    shard, replicate = mesh.group(shard_dim), mesh.group("dp_replicate")
    reduce_dtype = DTYPES[p.reduce_dtype]
    bucket_bytes = int(p.bucket_mb * 2**20)
    if shard.size == 1:
        return DistributedDataParallel(model, comm, mesh.group(whole_dim), bucket_bytes, reduce_dtype)
    if p.zero in (1, 2):
        return ZeroShardedOptimizer(
            model,
            comm,
            shard,
            replicate,
            p.zero,
            bucket_bytes,
            reduce_dtype,
            mesh.mesh(shard_dim),
            blocks,
            roots,
        )
    if p.fsdp_impl == "simple":
        hooked = [*(roots or [model]), *blocks]
        compiled = blocks if cfg.training.compile else None
        return SimpleFSDP(
            model, hooked, comm, shard, replicate, dtype, reduce_dtype, mesh.mesh(shard_dim), compiled
        )
    if p.fsdp_impl == "torch":
        device_mesh = mesh.world["dp_replicate", shard_dim] if replicate.size > 1 else mesh.mesh(shard_dim)
        return TorchFSDP(model, blocks, device_mesh, shard, dtype, reduce_dtype, p.reshard_after_forward)
    return FullyShardedDataParallel(
        model,
        blocks,
        comm,
        shard,
        replicate,
        dtype,
        reduce_dtype,
        p.reshard_after_forward,
        mesh.mesh(shard_dim),
        roots=roots,
    )
