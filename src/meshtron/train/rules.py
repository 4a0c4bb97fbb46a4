"""What the training loop's services need of the config: checkpoints of the layout, recompute that
compiled blocks can honour, and the Weights & Biases package when run.wandb_project asks for it. Torch-free (checks.py gathers every package's rules)."""

from __future__ import annotations

import importlib.util
import sys

from meshtron.config import Config
from meshtron.parallel.rules import uses_torch_fsdp


def checkpoint_unsupported(cfg: Config, world_size: int) -> list[str]:
    """The layouts whose checkpoints this version cannot write or read yet."""
    p, c = cfg.parallel, cfg.checkpoint
    if p.tp > 1 and uses_torch_fsdp(cfg, world_size) and (c.every or c.resume):
        return [
            "checkpoints of PyTorch's fully_shard over tensor-parallel shards are not implemented; use "
            "parallel.fsdp_impl='meshtron', or checkpoint.every=0 and checkpoint.resume=false"
        ]
    return []


def wandb_missing() -> bool:
    """Whether `import wandb` would fail; found without importing it (its import takes seconds)."""
    if "wandb" in sys.modules:  # imported already, or blocked (None), or stood in for by a test
        return sys.modules["wandb"] is None
    try:
        return importlib.util.find_spec("wandb") is None
    except (ImportError, ValueError):
        return True


def wandb_problems(cfg: Config) -> list[str]:
    """Config-time check: W&B logging asked for without the package."""
    if cfg.run.wandb_project and wandb_missing():
        return [
            f"run.wandb_project={cfg.run.wandb_project!r} needs the wandb package, which is not installed: "
            "pip install 'meshtron[wandb]' (or wandb), or leave run.wandb_project empty"
        ]
    return []


def recompute_problems(cfg: Config) -> list[str]:
    """Per-operation recompute keeps outputs through a dispatch mode, which compiled blocks bypass."""
    t = cfg.training
    if t.recompute == "op" and t.compile:
        return [
            "training.recompute='op' keeps chosen operations' outputs as they run, which compiled blocks do "
            "not show it: with training.compile=true it would recompute whole blocks; use "
            "training.recompute='full' or 'selective' with compile, or training.compile=false"
        ]
    return []
