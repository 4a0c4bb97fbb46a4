"""Checkpoints through torch.distributed.checkpoint: every rank writes its own part, in parallel.

The state is that of every logical parameter, by name: its value and its AdamW moments, each as the
rows this rank owns (a DTensor sharded on dim 0 when parameters are sharded), so a checkpoint written by
one data-parallel layout loads into any other (e.g. ZeRO-3 on 4 ranks -> DDP on 2 -> 1 device).

A checkpoint is written into `step-NNNNNNNN.tmp/` and renamed to `step-NNNNNNNN/` only once every rank
has finished, so a crash mid-save leaves the previous checkpoint as the newest complete one. The state
holds the model, the optimizer, the data sampler and the step, which is all an exact resume needs
(the learning rate is a function of the step; the model has no dropout).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from meshtron.comm import Comm, CommGroup
from meshtron.parallel.data import DataParallelEngine, OwnedRows

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this model; the message says what to do."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


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


def _optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state for `param`, created (as a fresh optimizer would) if it has not stepped yet."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _state(
    engine: DataParallelEngine, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
) -> dict[str, Any]:
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, dict[str, torch.Tensor]] = {}
    for entry in engine.owned_rows():
        rows = slice(0, entry.rows)
        model_sd[entry.name] = _wrap(entry.param.detach()[rows], entry, engine.shard_mesh)
        state = _optimizer_state(optimizer, entry.param)
        optim_sd[entry.name] = {
            "step": state["step"],
            "exp_avg": _wrap(state["exp_avg"][rows], entry, engine.shard_mesh),
            "exp_avg_sq": _wrap(state["exp_avg_sq"][rows], entry, engine.shard_mesh),
        }
    return {"model": model_sd, "optimizer": optim_sd, "train": train_state}


def save_checkpoint(
    root: Path,
    step: int,
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    comm: Comm,
    world: CommGroup,
    keep: int,
) -> Path:
    """Collective: every rank must call it. Returns the final directory."""
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save of this step
    comm.barrier(world)
    dcp.save(_state(engine, optimizer, train_state), checkpoint_id=str(tmp))
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old.path, ignore_errors=True)
    comm.barrier(world)
    return final


def load_checkpoint(
    path: Path, engine: DataParallelEngine, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
) -> dict[str, Any]:
    """Load `path` (written by any layout) into this layout in place; returns the saved train state."""
    state = _state(engine, optimizer, train_state)
    try:
        dcp.load(state, checkpoint_id=str(path))
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
