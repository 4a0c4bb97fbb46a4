"""Blocks of tensor- and expert-parallel shards in a checkpoint, through DCP's public planner API.

A parameter split over tensor parallel (and/or expert parallel) and then by rows over data parallel is,
on each rank, one rectangular block of the logical tensor: the tp slice along the split dim (the
vocabulary's padding rows left out), of which this rank owns some rows. DTensor placements cannot say
"tp outer, data parallel inner" on one dim when the sizes do not divide evenly, so these blocks are
written with explicit offsets instead:

  state dict    the block itself, a plain tensor (a view of the parameter or its AdamW moment)
  save planner  one SHARD write item per block: (offsets, sizes) in the logical tensor's size
  load planner  DCP's resharding reads (`create_read_items_for_chunk_list`) for the block's box

What lands on disk is DCP's usual chunked-tensor metadata, the form torch's ShardedTensor produced
(checkpoint format 1), so checkpoints written before this module load unchanged. Everything here is
public torch.distributed.checkpoint API: `DefaultSavePlanner`, `DefaultLoadPlanner`, the planner and
metadata dataclasses, and `create_read_items_for_chunk_list`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshtron.config.row_blocks import block_box
from meshtron.engines.engine import OwnedRows
from meshtron.engines.shard import ShardedShape
from meshtron.parallel.tensor import TensorParallelPlan

KeyPath = tuple[str, ...]  # a value's keys in the nested state dict, e.g. ("optimizer", name, "exp_avg")


@dataclass(frozen=True)
class Block:
    """Where this rank's block sits: `offsets` and `sizes` in a logical tensor of shape `size`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


@dataclass(frozen=True)
class ShardBlocks:
    """Where every rank of this rank's dp_shard_cp x tp slice of the mesh holds its rows of parameters
    split over tensor parallel and/or expert parallel: `ranks[k][t]` is the global rank at index k of
    dp_shard x cp and t of tp. A dense parameter's rows are sharded over all of dp_shard x cp; an expert
    parameter's (`experts`) over edp only: this rank, at (ep index e, edp index s, edp size) in the
    experts' grid (`expert_place`, config/layout.py), holds the e-th dim-0 block of what tensor parallel
    left, and its s-th row shard."""

    plan: TensorParallelPlan | None
    ranks: list[list[int]]
    ep: int = 1
    experts: frozenset[str] = frozenset()
    expert_place: tuple[int, int, int] = (0, 0, 1)

    def holds(self, name: str) -> bool:
        """Whether `name` is split over tp or ep (otherwise it is a plain dim-0 shard over dp_shard_cp)."""
        return name in self.experts or (self.plan is not None and self.plan.split_dims.get(name) is not None)

    def logical_shape(self, name: str, local_shape: tuple[int, ...]) -> list[int]:
        logical = list(local_shape)
        if name in self.experts:
            logical[0] *= self.ep
        split = self.plan.split_dims.get(name) if self.plan is not None else None
        if split is not None:
            logical[split[0]] = split[1]
        return logical

    def block(
        self, name: str, local_shape: tuple[int, ...], t: int, k: int, rows_shape: tuple[int, ...] = ()
    ) -> tuple[list[int], list[int]] | None:
        """(offsets, sizes) in the logical tensor of the rows this rank, (k, t) in `ranks`, owns of
        parameter `name`, whose per-rank shape before data-parallel sharding is `local_shape` and whose
        rows the engine counts in `rows_shape` (a stack cut within its matrices; empty: `local_shape`);
        None: padding only."""
        ep, (e, s, shards) = (
            (self.ep, self.expert_place) if name in self.experts else (1, (0, k, len(self.ranks)))
        )
        offsets, sizes = [0] * len(local_shape), list(local_shape)
        valid_rows = local_shape[0]
        split = self.plan.split_dims.get(name) if self.plan is not None else None
        if split is not None:
            dim, logical = split
            per_tp = local_shape[dim] * (ep if dim == 0 else 1)
            valid_tp = max(0, min(per_tp, logical - t * per_tp))  # the padded vocabulary's last shard
            offsets[dim], sizes[dim] = t * per_tp, valid_tp
            if dim == 0:
                valid_rows, sizes[0] = min(valid_rows, valid_tp), local_shape[0]
        rows_shape = tuple(rows_shape) or tuple(local_shape)
        start, stop = ShardedShape(rows_shape, shards).row_range(s)
        stop = min(stop, valid_rows) if rows_shape == tuple(local_shape) else stop
        box_offsets, box_sizes = block_box(tuple(local_shape), rows_shape, start, max(0, stop - start))
        offsets[0] += e * local_shape[0]
        cut = 1 if rows_shape == tuple(local_shape) else 2  # the dims the rows' box sits in
        for d in range(cut):
            offsets[d] += box_offsets[d]
            sizes[d] = box_sizes[d]
        return (offsets, sizes) if min(sizes) > 0 else None

    def place(self, local: torch.Tensor, entry: OwnedRows) -> tuple[torch.Tensor, Block | None]:
        """This rank's rows of its tp/ep shard cut to its block (a view), and where the block sits
        (None: this rank holds only padding of `entry`)."""
        me_t = self.plan.tp.rank if self.plan is not None else 0
        me_k = next(i for i, row in enumerate(self.ranks) if dist.get_rank() in row)
        found = self.block(entry.name, entry.shape, me_t, me_k, entry.row_shape)
        if found is None:
            return local[:0], None
        offsets, sizes = found
        view = local.view(sizes) if entry.row_shape else local[tuple(slice(0, n) for n in sizes)]
        size = tuple(self.logical_shape(entry.name, entry.shape))
        return view, Block(tuple(offsets), tuple(sizes), size)


def _by_fqn(mappings: dict[str, KeyPath], blocks: dict[KeyPath, Block | None]) -> dict[str, Block | None]:
    """The blocks under DCP's flattened names ("model.layers.0...", "optimizer....exp_avg")."""
    return {fqn: blocks[path] for fqn, path in mappings.items() if path in blocks}


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save plan, except that each value in `blocks` is written as one chunk at its
    offsets in the logical tensor (and not at all by a rank holding only padding)."""

    def __init__(self, blocks: dict[KeyPath, Block | None]) -> None:
        super().__init__()
        self.blocks = blocks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._blocks = _by_fqn(self.mappings, self.blocks)
        items = []
        for item in plan.items:
            if item.index.fqn not in self._blocks:
                items.append(item)
            elif (block := self._blocks[item.index.fqn]) is not None:
                tensor_data = TensorWriteData(
                    chunk=block.chunk(), properties=item.tensor_data.properties, size=torch.Size(block.size)
                )
                index = MetadataIndex(item.index.fqn, torch.Size(block.offsets))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=tensor_data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._blocks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load plan, except that each value in `blocks` reads the box it covers from
    whatever chunks the checkpoint holds (any layout's)."""

    def __init__(self, blocks: dict[KeyPath, Block | None]) -> None:
        super().__init__()
        self.blocks = blocks

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "DCP sets the metadata before planning"
        self._blocks = _by_fqn(self.mappings, self.blocks)
        rest = {fqn: value for fqn, value in self.state_dict.items() if fqn not in self._blocks}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, block in self._blocks.items():
            if block is None:
                continue
            saved = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(saved, TensorStorageMetadata):
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if tuple(saved.size) != block.size:
                raise ValueError(
                    f"Size mismatch between saved {saved.size} and current: {block.size} for {fqn}"
                )
            items += create_read_items_for_chunk_list(fqn, saved, [block.chunk()])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._blocks:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)
