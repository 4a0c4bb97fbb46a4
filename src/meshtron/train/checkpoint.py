"""Checkpoints through torch.distributed.checkpoint: every rank writes its own part, in parallel.

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
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from meshtron.comm import Comm, CommGroup

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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "train": train_state}


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
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
    dcp.save(_state(model, optimizer, train_state), checkpoint_id=str(tmp))
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old.path, ignore_errors=True)
    comm.barrier(world)
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
) -> dict[str, Any]:
    """Load `path` into model and optimizer in place; returns the saved train state (step, sampler)."""
    state = _state(model, optimizer, train_state)
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
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["train"]
