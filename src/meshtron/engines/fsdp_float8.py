"""ZeRO-3's all-gather with the float8 layers' weights sent in float8 (`training.fp8_all_gather`).

With `training.dtype = "fp8"` the projections quantize their weights to e4m3 anyway, so gathering
those weights in e4m3 instead of bf16 halves their bytes on the wire (torchao's float8 all-gather for
FSDP2 does the same). A unit's gather then carries, per rank, one byte buffer:

  [ e4m3 rows of the unit's float8 weights | bf16 rows of its other parameters ]

Each float8 weight is cast with one scale for the whole weight (amax / 448): every rank computes the
amax of its rows and one all-reduce (max) per unit over the shard group makes them the weight's. After
the gather each weight is widened back into its bf16 parameter (q · scale), from which the float8 layer
casts it again: with the tensorwise recipe that cast finds the same amax and gives the same e4m3
values, so the layer computes what it would from a bf16 gather, up to bf16's rounding of q · scale.
(Rowwise scales would need one scale per row on the wire: refused, rules/training.py.)
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.engines.shard import FlatLayout
from meshtron.models.float8 import E4M3

ALIGN = 16  # bytes: the bf16 section starts aligned


class Float8Gather:
    """How one FSDP unit packs, gathers and unpacks its parameters with the float8 ones in e4m3."""

    def __init__(
        self,
        params: list[nn.Parameter],
        float8: list[bool],
        shard: CommGroup,
        param_dtype: torch.dtype,
        cut_within: bool = True,
    ):
        self.f8 = [i for i, is_f8 in enumerate(float8) if is_f8]
        self.rest = [i for i, is_f8 in enumerate(float8) if not is_f8]
        shapes = [tuple(p.shape) for p in params]
        self.layout8 = FlatLayout([shapes[i] for i in self.f8], shard.size, shard.rank, cut_within)
        self.layout16 = FlatLayout([shapes[i] for i in self.rest], shard.size, shard.rank, cut_within)
        self.param_dtype = param_dtype
        self.bytes8 = -(-self.layout8.shard_numel // ALIGN) * ALIGN
        self.bytes16 = self.layout16.shard_numel * torch.finfo(param_dtype).bits // 8
        self.per_rank = self.bytes8 + self.bytes16
        self.scales = torch.ones(len(self.f8))

    @torch.no_grad()
    def pack(self, comm: Comm, shard: CommGroup, master: list[torch.Tensor]) -> torch.Tensor:
        """This rank's bytes: its float8 weights' rows cast with whole-weight scales, the rest in bf16."""
        amax = torch.stack([master[i].abs().amax() for i in self.f8]) if self.f8 else torch.zeros(0)
        amax = comm.all_reduce_(amax.float(), shard, op="max") if self.f8 else amax
        self.scales = torch.clamp(amax, min=1e-12) / torch.finfo(E4M3).max
        send = torch.zeros(self.per_rank, dtype=torch.uint8, device=master[0].device)
        views8 = self.layout8.local_views(send[: self.layout8.shard_numel].view(E4M3))
        for view, i, scale in zip(views8, self.f8, self.scales, strict=True):
            view.copy_((master[i] / scale).to(E4M3))
        views16 = self.layout16.local_views(send[self.bytes8 :].view(self.param_dtype))
        for view, i in zip(views16, self.rest, strict=True):
            view.copy_(master[i])
        return send

    @torch.no_grad()
    def unpack(self, gathered: torch.Tensor, params: list[nn.Parameter], size: int) -> None:
        """The gathered bytes of every rank into the full parameters (float8 ones widened, times scale)."""
        by_rank = gathered.view(size, self.per_rank)
        full8 = by_rank[:, : self.layout8.shard_numel].contiguous().view(E4M3).flatten()
        weights = [params[i].data for i in self.f8]
        self.layout8.unpack(full8, weights)
        for weight, scale in zip(weights, self.scales, strict=True):
            weight.mul_(scale.to(weight.device))
        full16 = by_rank[:, self.bytes8 :].contiguous().view(self.param_dtype).flatten()
        self.layout16.unpack(full16, [params[i].data for i in self.rest])
