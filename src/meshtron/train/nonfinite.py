"""Non-finite steps: a step whose loss or gradient norm is inf or NaN changes nothing, and says why.

The loss (summed over every rank) and the gradient norm (clipping's, over every rank) are the same
numbers on every rank, so every rank decides alike to skip: no optimizer step (parameters and AdamW
state untouched), gradients zeroed, the batch consumed. The metrics row is marked `skipped` with what
was non-finite and the first parameter (in model order) whose gradient held an inf or NaN on any rank.
`training.max_skipped_steps` skips in a row stop the run with `TrainingDiverged`: a diverging run ends
with a non-zero exit and a message, instead of logging NaN to the last step.
"""

from __future__ import annotations

import math
import re

import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.engines.engine import DataParallelEngine
from meshtron.train import TrainingDiverged


def _model_order(name: str) -> tuple[int, int, str]:
    """Embedding first, then the blocks by layer number, then the final norm and head."""
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer:
        return (1, int(layer.group(1)), name)
    return (0 if "embed" in name else 2, 0, name)


def first_nonfinite_gradient(engine: DataParallelEngine, comm: Comm, world: CommGroup) -> str | None:
    """Collective over `world`: the first parameter, in model order, whose gradient (the rows any rank
    holds) is not finite; None when every gradient is finite."""
    mine = None
    for entry in engine.owned_rows():
        grad = entry.param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad[: entry.rows]
        if not bool(torch.isfinite(local).all()):
            mine = entry.name if mine is None else min(mine, entry.name, key=_model_order)
    found = [name for name in comm.all_gather_object(mine, world) if name is not None]
    return min(found, key=_model_order) if found else None


class SkipGuard:
    """Counts non-finite steps in a row and stops the run after `max_in_a_row` of them."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.in_a_row = max_in_a_row, 0

    def check(self, step: int, loss: float, grad_norm: float, first_bad: str | None) -> dict[str, object]:
        """The row fields of a skipped step ({} for a finite one); raises TrainingDiverged past the limit."""
        bad = [what for what, value in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(value)]
        if not bad:
            self.in_a_row = 0
            return {}
        self.in_a_row += 1
        where = f"; first non-finite gradient: {first_bad}" if first_bad else "; every gradient was finite"
        reason = f"step {step}: non-finite {' and '.join(bad)} ({loss=}, {grad_norm=}){where}"
        if self.in_a_row > self.max_in_a_row:
            raise TrainingDiverged(
                f"{self.in_a_row} non-finite steps in a row (training.max_skipped_steps="
                f"{self.max_in_a_row}), the last {reason}. The run diverged: lower training.lr, raise "
                "training.warmup_steps, or resume from an earlier checkpoint"
            )
        return {
            "skipped": True,
            "nonfinite": " and ".join(bad),
            "first_nonfinite_grad": first_bad,
            "reason": reason,
        }
