"""Where this rank's tensors sit in the logical parameters, and filling them from any source.

After `parallelize`, a rank holds, of every logical parameter it has any of, a rectangle: tensor parallel
cut a dim (tp_plan.split_dims), expert parallel a range of experts (dim 0), and the data-parallel engine
holds rows of what is left (`owned_rows`: whole parameters for DDP, a row block for ZeRO-1/2's optimizer
and ZeRO-3, a DTensor shard for fully_shard). `fill_owned_` asks a source for exactly those rectangles,
the logical values, written in place: the seeded initialisation (models/init.py) and a Hugging
Face checkpoint (hf/init_from.py) are two sources, so a rank never builds, reads or draws anything it
does not hold. Rows of the padded vocabulary (tensor parallel rounds it up) are zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from meshtron.comm.group import CommGroup
from meshtron.config.schema import ModelConfig
from meshtron.engines.engine import OwnedRows
from meshtron.models.init import init_region_
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.parallelize import ParallelModel
from meshtron.parallel.tensor import TensorParallelPlan

Region = list[tuple[int, int]]  # (start, stop) per dim of a logical parameter
# (logical name, logical shape, region, out): writes the logical values there into `out` (of the region's
# shape, in the target's dtype), so that no source needs a copy of what it fills besides the target itself
Source = Callable[[str, tuple[int, ...], Region, torch.Tensor], None]


def local_rows(entry: OwnedRows) -> tuple[torch.Tensor, Region, tuple[int, ...]]:
    """(the tensor this rank holds of `entry`, its held rows first and padding after; the box of the
    parameter as tensor and expert parallel left it that those rows are; that parameter's shape)."""
    param = entry.param
    if isinstance(param, DTensor):  # fully_shard: the DTensor's placements say where its rows sit
        # DTensor's side of DCP's checkpoint protocol: the box of the logical tensor this rank holds.
        (box,) = param.__create_chunk_list__()
        return (
            param.to_local(),
            [(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True)],
            param.shape,
        )
    offsets, sizes = entry.box()
    return param.data, [(o, o + n) for o, n in zip(offsets, sizes, strict=True)], entry.shape


def logical_region(
    name: str,
    local_shape: tuple[int, ...],
    box: Region,
    plan: TensorParallelPlan | None,
    expert: tuple[int, int] | None,
) -> tuple[Region, tuple[int, ...]]:
    """(the region of logical parameter `name` that `box` of this rank's `local_shape` tensor is (cut by
    tensor parallel per `plan`, then by expert parallel when `expert` is (ep rank, ep size)), without
    the rows past the logical end (the padded vocabulary's); the logical shape)."""
    offsets, logical = [0] * len(local_shape), list(local_shape)
    ep_rank, ep = expert if expert is not None else (0, 1)
    offsets[0], logical[0] = ep_rank * local_shape[0], local_shape[0] * ep
    split = plan.split_dims.get(name) if plan is not None else None
    if split is not None:  # tensor parallel cut first: its blocks hold whole ep blocks along dim 0
        dim, size = split
        offsets[dim] += plan.tp.rank * local_shape[dim] * (ep if dim == 0 else 1)
        logical[dim] = size
    region = [(o + a, o + b) for o, (a, b) in zip(offsets, box, strict=True)]
    region[0] = (min(region[0][0], logical[0]), min(region[0][1], logical[0]))
    return region, tuple(logical)


def held_rows(target: torch.Tensor, region: Region) -> int:
    """How many of the first rows of `target` (a rank's rows, padding after) hold `region`."""
    return math.prod(b - a for a, b in region) // max(1, math.prod(target.shape[1:]))


@torch.no_grad()
def fill_owned_(parallel: ParallelModel, source: Source, ep: CommGroup) -> int:
    """Overwrite everything this rank holds (`engine.owned_rows()`) with `source`'s values of it, which the
    source writes in place, padding with zeros; returns the elements read. Local: the caller then lets the
    engine refresh what it derives from them (`engine.load_owned_rows()`, collective: e.g. ZeRO-1/2 gathers
    the whole parameters)."""
    experts = expert_parameter_names(parallel.model) if ep.size > 1 else frozenset()
    elements = 0
    for entry in parallel.engine.owned_rows():
        target, box, shape = local_rows(entry)
        where = (ep.rank, ep.size) if entry.name in experts else None
        region, logical = logical_region(entry.name, shape, box, parallel.tp_plan, where)
        rows = held_rows(target, region)
        target[rows:].zero_()  # the padding rows
        if any(stop <= first for first, stop in region):
            continue  # padding only
        held = target[:rows].view([b - a for a, b in region])
        source(entry.name, logical, region, held)
        elements += held.numel()
    return elements


@torch.no_grad()
def initialize_(parallel: ParallelModel, cfg: ModelConfig, seed: int, ep: CommGroup) -> None:
    """Collective: every parameter this rank holds at its initial values (models/init.py), each rank
    drawing only its own regions; the same values as the single-device initialisation's, bit for bit."""
    fill_owned_(
        parallel, lambda name, shape, region, out: init_region_(out, name, shape, region, cfg, seed), ep
    )
    parallel.engine.load_owned_rows()
