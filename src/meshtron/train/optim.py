"""The optimizer side of a step: AdamW, the learning-rate schedule, and exact gradient clipping.

Clipping computes the norm of the whole model's gradient however it is split, its sums of squares in
float64 so that every layout gets the same float32 norm: each gradient element is owned by exactly one rank
of the data-parallel shard group, parameters split over tensor parallel are
summed over tp while those every tp rank holds whole are counted once, and pipeline stages hold
disjoint parameters (a tied embedding's second copy is left out on the last stage).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import TrainingConfig
from meshtron.engines.engine import DataParallelEngine
from meshtron.parallel.tensor import TensorParallelPlan


def lr_at(step: int, t: TrainingConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def clip_grad_norm_(
    engine: DataParallelEngine,
    max_norm: float,
    comm: Comm,
    tp_plan: TensorParallelPlan | None = None,
    pp: CommGroup | None = None,
    counted_elsewhere: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """Global gradient norm with every element counted once however it is sharded or split; scales the
    gradients in place when it exceeds max_norm (max_norm <= 0: no clipping). Returns the norm.
    `counted_elsewhere`: parameters this rank holds a copy of that another pipeline stage counts."""
    whole = frozenset()
    if tp_plan is not None:
        apart = tp_plan.split_dims.keys() | tp_plan.placed_by_ep
        whole = frozenset(e.name for e in engine.owned_rows() if e.name not in apart)
    parts = engine.grad_norm_sq_parts(whole, counted_elsewhere)
    if engine.norm_group is not None:
        comm.all_reduce_(parts, engine.norm_group)
    if tp_plan is not None:
        comm.all_reduce_(parts[:1], tp_plan.tp)
    if pp is not None:  # pipeline stages hold disjoint parameters
        comm.all_reduce_(parts, pp)
    norm = parts.sum().sqrt().float()  # float64 sums (engine.sum_of_squares): the same in every layout
    if (
        max_norm > 0
    ):  # without reading the norm on the host: a non-finite one scales by 1 (the step is skipped)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        engine.scale_grads_(torch.where(torch.isfinite(norm), scale, torch.ones_like(scale)))
    return norm


def build_optimizer(
    params: list[nn.Parameter], lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases or other 1-D gains). A shard keeps its
    parameter's number of dims, so the grouping is the same whatever the layout."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
