"""Replicated data parallel: every rank holds the whole model; gradients are averaged after backward.

This is the plain form (one all-reduce per parameter, once per optimizer step, after the last
micro-batch). Each rank's loss is already normalised by the global token count, so the average of the
ranks' gradients times the data-parallel size is the single-device gradient: we sum, not average.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.comm import Comm, CommGroup


@torch.no_grad()
def broadcast_parameters(model: nn.Module, comm: Comm, group: CommGroup) -> None:
    """Make every replica start from rank 0's weights (they are seeded identically; this makes it a fact)."""
    for param in model.parameters():
        comm.broadcast_(param.data, group, src=0)


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, comm: Comm, group: CommGroup) -> None:
    """Sum gradients over the replicas; the loss was divided by the global token count, not the local one."""
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce_(param.grad, group, op="sum")
