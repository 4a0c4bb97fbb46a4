"""What every data-parallel engine is built from, as Megatron-Core's module, `ddp_config` and
`pg_collection`: what it wraps (`EngineModel`: the parameters and the modules that use them), the groups
it talks over with the comm layer (`EngineGroups`), and the layout's data-parallel options
(`DataParallelSettings`). Every engine's constructor takes exactly these three."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import Config, FsdpImpl
from meshtron.models.layers import DTYPES


@dataclass(frozen=True, kw_only=True)
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
    # A stack of expert matrices the shard group does not divide is cut within its matrices (unpadded,
    # config/row_blocks.py); Muon needs each matrix whole on one rank, so not with Muon.
    cut_within: bool = True
    # DiLoCo (train/diloco.py): nothing is reduced across dp_replicate; the replicas train apart.
    replicas_apart: bool = False

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
            cut_within=cfg.training.optimizer != "muon",
            replicas_apart=cfg.fault_tolerance.diloco_every > 0,
        )


class Parameters(Protocol):
    """A module, or some of its parameters (engines/expert.py's ParameterSubset): what engines read."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """What an engine wraps: the parameters it owns and the modules that use them."""

    model: Parameters  # the model, or the subset of its parameters this engine owns
    blocks: list[nn.Module] = field(default_factory=list)  # gathered (ZeRO-1/2/3) one unit each, in order
    # The modules whose forwards use the parameters outside `blocks` (embedding, final norm, head): the
    # model itself (None), or under pipeline parallel the stage's chunks that hold them.
    roots: list[nn.Module] | None = None
    # The pipeline chunks this rank runs, in order (none: the model runs as one): ZeRO-3 prefetches the
    # next unit only inside the chunk that is running.
    chunks: list[nn.Module] = field(default_factory=list)
    float8: frozenset[str] = frozenset()  # parameters ZeRO-3 gathers in float8 (training.fp8_all_gather)
    # Every replica is initialised (or loaded) identically after construction, as after a meta-device
    # build: DDP need not broadcast rank 0's values.
    identical_replicas: bool = False

    @property
    def root_modules(self) -> list[Any]:
        return self.roots or [self.model]


@dataclass(frozen=True, kw_only=True)
class EngineGroups:
    """The ranks an engine reduces and shards over, and the comm layer it talks through: a sharded engine
    splits over `shard` and all-reduces its shards across `replicate`; DDP all-reduces whole gradients
    over `replicate` alone."""

    comm: Comm
    shard: CommGroup  # the ranks that split parameters, gradients or optimizer state between them
    replicate: CommGroup  # the ranks holding the same shard (or, for DDP, the same whole parameters)
    shard_mesh: Any = None  # `shard` as a DeviceMesh (DTensor views of what a rank holds), if any
