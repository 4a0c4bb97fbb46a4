"""Checkpoints through torch.distributed.checkpoint: every rank writes its own part, in parallel.

The state is that of every logical parameter, by name: its value and its AdamW moments, each as the
block of the logical tensor this rank holds, so a checkpoint written by one layout loads into any other
(e.g. ZeRO-3 on 4 ranks -> DDP on 2 -> 1 device; tp 2 x pp 2 -> tp 4). A block is

  - a DTensor sharded on dim 0 over dp_shard, for parameters whole on every tensor-parallel rank
    (their copies on the other tp ranks are the same entries, written once);
  - a ShardedTensor with explicit offsets, for parameters split over tensor parallel: the tp slice
    (along its split dim) holds the rows this rank owns over dp_shard; the vocabulary's padding rows
    are left out. (DTensor placements cannot say "tp outer, data parallel inner" on one dim when sizes
    do not divide evenly; explicit offsets can.)

A checkpoint is written into `step-NNNNNNNN.tmp/` and renamed to `step-NNNNNNNN/` only once every rank
has finished, so a crash mid-save leaves the previous checkpoint as the newest complete one. The state
holds the model (with MoE routers' balancing biases), the optimizer, the data sampler and the step, which
is all an exact resume needs
(the learning rate is a function of the step; the model has no dropout). Beside it, rank 0 writes the
files the trainer passes (the run's resolved `config.toml` and its `tokenizer.json`), so that one
directory is enough to rebuild the model on one device (`load_model_weights`, `meshtron export`).
"""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from meshtron.comm import Comm, CommGroup
from meshtron.config import Config, ModelConfig
from meshtron.models.llama import Transformer, rope_inv_freq
from meshtron.parallel.data_parallel import uses_torch_fsdp
from meshtron.parallel.engine import DataParallelEngine, OwnedRows
from meshtron.parallel.shard import ShardedShape
from meshtron.parallel.tensor import TensorParallelPlan
from meshtron.train.checkpoint_integrity import write_manifest
from meshtron.train.safe_checkpoint_reader import SafeFileSystemReader

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this model; the message says what to do."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def checkpoint_unsupported(cfg: Config, world_size: int) -> list[str]:
    """The layouts whose checkpoints this version cannot write or read yet."""
    p, c = cfg.parallel, cfg.checkpoint
    if p.tp > 1 and uses_torch_fsdp(cfg, world_size) and (c.every or c.resume):
        return [
            "checkpoints of PyTorch's fully_shard over tensor-parallel shards are not implemented; use "
            "parallel.fsdp_impl='meshtron', or checkpoint.every=0 and checkpoint.resume=false"
        ]
    return []


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Finished checkpoints under root, oldest first (unfinished `.tmp` directories are ignored)."""
    if not root.is_dir():
        return []
    found = [
        CheckpointInfo(int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return sorted(found, key=lambda c: c.step)


def _wrap(local: torch.Tensor, entry: OwnedRows, mesh: Any) -> torch.Tensor:
    """This rank's rows as a DTensor sharded on dim 0 (a plain tensor when nothing is sharded), so DCP
    records where they sit in the logical tensor and any other layout can read them back."""
    if mesh is None or isinstance(local, DTensor):
        return local
    shape = torch.Size(entry.shape)
    return DTensor.from_local(
        local,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


@dataclass(frozen=True)
class ShardBlocks:
    """Where every rank of this rank's dp_shard_cp x tp slice of the mesh holds its rows of parameters
    split over tensor parallel and/or expert parallel: `ranks[k][t]` is the global rank at index k of
    dp_shard x cp and t of tp. A dense parameter's rows are sharded over all of dp_shard x cp; an expert
    parameter's (`experts`) over edp only, index k being (edp k // ep, ep k % ep), and ep rank e holds the
    e-th dim-0 block of what tensor parallel left."""

    plan: TensorParallelPlan | None
    ranks: list[list[int]]
    ep: int = 1
    experts: frozenset[str] = frozenset()

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
        self, name: str, local_shape: tuple[int, ...], t: int, k: int
    ) -> tuple[list[int], list[int]] | None:
        """(offsets, sizes) in the logical tensor of the rows rank (k, t) owns of parameter `name`, whose
        per-rank shape before data-parallel sharding is `local_shape` (None: padding only)."""
        ep = self.ep if name in self.experts else 1
        s, e = divmod(k, ep)
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
        start, stop = ShardedShape(local_shape, len(self.ranks) // ep).row_range(s)
        stop = min(stop, valid_rows)
        offsets[0] += e * local_shape[0] + start
        sizes[0] = stop - start
        return (offsets, sizes) if min(sizes) > 0 else None

    def wrap(self, local: torch.Tensor, entry: OwnedRows) -> ShardedTensor:
        """This rank's rows of its tp/ep shard, as a ShardedTensor that knows every rank's block."""
        me_t = self.plan.tp.rank if self.plan is not None else 0
        me_k = next(i for i, row in enumerate(self.ranks) if dist.get_rank() in row)
        device = local.device.type
        shards, mine = [], None
        for k, row in enumerate(self.ranks):
            for t, rank in enumerate(row):
                block = self.block(entry.name, entry.shape, t, k)
                if block is not None:
                    shards.append(ShardMetadata(block[0], block[1], f"rank:{rank}/{device}"))
                    if (t, k) == (me_t, me_k):
                        mine = shards[-1]
        local_shards = [LocalShard(local[: mine.shard_sizes[0]], mine)] if mine is not None else []
        metadata = ShardedTensorMetadata(
            shards,
            torch.Size(self.logical_shape(entry.name, entry.shape)),
            TensorProperties.create_from_tensor(local),
        )
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def _optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state for `param`, created (as a fresh optimizer would) if it has not stepped yet."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _state(
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    tp_blocks: ShardBlocks | None,
) -> dict[str, Any]:
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, dict[str, torch.Tensor]] = {}
    for entry in engine.owned_rows():
        if tp_blocks is not None and tp_blocks.holds(entry.name):
            wrap = partial(tp_blocks.wrap, entry=entry)
        else:
            wrap = partial(_wrap, entry=entry, mesh=engine.shard_mesh)
        rows = slice(0, entry.rows)
        model_sd[entry.name] = wrap(entry.param.detach()[rows])
        state = _optimizer_state(optimizer, entry.param)
        optim_sd[entry.name] = {
            "step": state["step"],
            "exp_avg": wrap(state["exp_avg"][rows]),
            "exp_avg_sq": wrap(state["exp_avg_sq"][rows]),
        }
    # Auxiliary-loss-free balancing biases: the same on every rank holding their layer (saved once).
    model_sd.update({n: b for n, b in engine.model.named_buffers() if n.endswith("expert_bias")})
    # Plain numbers as tensors: DCP stores other values with pickle (safe_checkpoint_reader.py).
    train = {k: {n: torch.tensor(v) for n, v in part.items()} for k, part in train_state.items()}
    return {"model": model_sd, "optimizer": optim_sd, "train": train}


def save_checkpoint(
    root: Path,
    step: int,
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    comm: Comm,
    world: CommGroup,
    keep: int,
    tp_blocks: ShardBlocks | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Collective: every rank must call it. Returns the final directory. Refuses (on every rank) to write
    parameters or optimizer state holding inf or NaN. `files` (name -> contents) are written beside the
    state by rank 0, inside the manifest."""
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    state = _state(engine, optimizer, train_state, tp_blocks)
    bad = sorted({n for part in comm.all_gather_object(_non_finite(state), world) for n in part})
    if bad:
        raise CheckpointError(f"refusing to write checkpoint {final}: non-finite values in {', '.join(bad)}")
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save of this step
    comm.barrier(world)
    dcp.save(state, checkpoint_id=str(tmp))
    if world.rank == 0:
        for name, contents in (files or {}).items():
            (tmp / name).write_bytes(contents)
    comm.barrier(world)
    write_manifest(tmp, comm, world)
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old.path, ignore_errors=True)
    comm.barrier(world)
    return final


def _non_finite(state: dict[str, Any]) -> list[str]:
    """Names of this rank's model and optimizer tensors holding inf or NaN."""

    def local(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, ShardedTensor):
            return (
                torch.cat([s.tensor.flatten() for s in t.local_shards()])
                if t.local_shards()
                else t.new_zeros(0)
            )
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [(n, t) for n, t in state["model"].items()]
    tensors += [(f"{n} ({k})", t) for n, s in state["optimizer"].items() for k, t in s.items() if k != "step"]
    return [
        name
        for name, t in tensors
        if local(t).is_floating_point() and not bool(torch.isfinite(local(t)).all())
    ]


def load_checkpoint(
    path: Path,
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    tp_blocks: ShardBlocks | None = None,
) -> dict[str, Any]:
    """Load `path` (written by any layout) into this layout in place; returns the saved train state."""
    state = _state(engine, optimizer, train_state, tp_blocks)
    try:
        # Read first on its own: inside dcp.load a refused metadata file is taken for a missing one.
        SafeFileSystemReader(str(path)).read_metadata()
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {path} is not a meshtron checkpoint: {err}") from None
    except (CheckpointException, RuntimeError, ValueError) as err:
        # DCP wraps per-rank failures (in a BaseException); keep the line that names the tensor.
        lines = [line for line in str(err).splitlines() if "Error" in line or "mismatch" in line.lower()]
        detail = lines[-1].strip() if lines else str(err).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model and optimizer: {detail}. "
            "Resume with the config it was written with, or start a new run.dir"
        ) from None
    engine.load_owned_rows()
    return state["train"]


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Fill a single-device model in place from checkpoint `path` (written by any layout), in this
    process alone: no process group is needed, and none is used if one exists. Only the model's
    entries are read (not the optimizer's); each is assembled from the row and tp/ep blocks it was
    saved as."""
    state = {"model": model.state_dict()}
    try:
        SafeFileSystemReader(str(path)).read_metadata()  # refused metadata named, not taken for missing
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {path} is not a meshtron checkpoint: {err}") from None
    except (CheckpointException, RuntimeError, ValueError) as err:
        lines = [line for line in str(err).splitlines() if "Error" in line or "mismatch" in line.lower()]
        detail = lines[-1].strip() if lines else str(err).splitlines()[0]
        raise CheckpointError(f"checkpoint {path} does not fit this model: {detail}") from None


def checkpoint_model(path: Path, cfg: ModelConfig) -> Transformer:
    """The single-device model checkpoint `path` holds, whatever layout wrote it: fp32 (the master
    weights), on the CPU."""
    with torch.device("meta"):  # no time spent initialising weights the checkpoint overwrites
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    for name, buffer in model.named_buffers():
        if name.endswith("loads_2E"):
            buffer.zero_()  # expert load counters: not state, they start from nothing
    model.rope_inv_freq = rope_inv_freq(cfg)  # computed, never stored
    load_model_weights(path, model)
    return model
