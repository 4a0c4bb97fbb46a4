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


def local_rows(entry: OwnedRows) -> tuple[torch.Tensor, int, int, tuple[int, ...]]:
    """(the tensor this rank holds of `entry`, the index of its first row and its number of rows in the
    parameter as tensor and expert parallel left it, that parameter's shape)."""
    param = entry.param
    if isinstance(param, DTensor):  # fully_shard: the DTensor's placements say where its rows sit
        # DTensor's side of DCP's checkpoint protocol: the box of the logical tensor this rank holds.
        (box,) = param.__create_chunk_list__()
        return param.to_local(), box.offsets[0], box.sizes[0], tuple(param.shape)
    return param.data, entry.start, entry.rows, entry.shape


def logical_region(
    name: str,
    local_shape: tuple[int, ...],
    start: int,
    rows: int,
    plan: TensorParallelPlan | None,
    expert: tuple[int, int] | None,
) -> tuple[Region, tuple[int, ...]]:
    """(the region of logical parameter `name` held in rows [start, start + rows) of this rank's
    `local_shape` tensor (cut by tensor parallel per `plan`, then by expert parallel when `expert` is
    (ep rank, ep size)), without the rows past the logical end (the padded vocabulary's); the logical
    shape)."""
    offsets, logical = [0] * len(local_shape), list(local_shape)
    ep_rank, ep = expert if expert is not None else (0, 1)
    offsets[0], logical[0] = ep_rank * local_shape[0], local_shape[0] * ep
    split = plan.split_dims.get(name) if plan is not None else None
    if split is not None:  # tensor parallel cut first: its blocks hold whole ep blocks along dim 0
        dim, size = split
        offsets[dim] += plan.tp.rank * local_shape[dim] * (ep if dim == 0 else 1)
        logical[dim] = size
    region = [(o, o + n) for o, n in zip(offsets, local_shape, strict=True)]
    first = offsets[0] + start
    region[0] = (min(first, logical[0]), min(first + rows, logical[0]))
    return region, tuple(logical)


@torch.no_grad()
def fill_owned_(parallel: ParallelModel, source: Source, ep: CommGroup) -> int:
    """Overwrite everything this rank holds (`engine.owned_rows()`) with `source`'s values of it, which the
    source writes in place, padding with zeros; returns the elements read. Local: the caller then lets the
    engine refresh what it derives from them (`engine.load_owned_rows()`, collective: e.g. ZeRO-1/2 gathers
    the whole parameters)."""
    experts = expert_parameter_names(parallel.model) if ep.size > 1 else frozenset()
    elements = 0
    for entry in parallel.engine.owned_rows():
        target, start, rows, shape = local_rows(entry)
        where = (ep.rank, ep.size) if entry.name in experts else None
        region, logical = logical_region(entry.name, shape, start, rows, parallel.tp_plan, where)
        held = region[0][1] - region[0][0]
        target[held:].zero_()  # the padding rows
        if any(stop <= first for first, stop in region):
            continue  # padding only
        source(entry.name, logical, region, target[:held])
        elements += target[:held].numel()
    return elements


@torch.no_grad()
def initialize_(parallel: ParallelModel, cfg: ModelConfig, seed: int, ep: CommGroup) -> None:
    """Collective: every parameter this rank holds at its initial values (models/init.py), each rank
    drawing only its own regions; the same values as the single-device initialisation's, bit for bit."""
    fill_owned_(
        parallel, lambda name, shape, region, out: init_region_(out, name, shape, region, cfg, seed), ep
    )
    parallel.engine.load_owned_rows()
