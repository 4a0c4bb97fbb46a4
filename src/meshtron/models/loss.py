"""The training loss of a micro-batch, as every layout forms it.

Each micro-batch's cross-entropy is summed over its tokens and divided by the *global* token count of
the step (all micro-batches of all data-parallel ranks; with a loss mask, the targets of the global
batch that count, which every rank reads from the data), and an MoE model's aux loss (a mean over the
micro-batch's tokens) is weighted by the micro-batch's share of all the step's tokens. Summing the micro-batches'
losses over a step and over the data-parallel ranks then gives the mean over the global batch, so no
layout ever averages gradients, and any layout computes the same update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtron.data import IGNORE_INDEX


def cross_entropy_per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [N] of every token (in fp32; 0 where the target is IGNORE_INDEX), for the loss to be
    summed and normalised by the caller."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )


@dataclass
class MicroBatchLoss:
    """How each micro-batch's loss is formed in a step, and the autocast its forward runs under."""

    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # per-token cross-entropy [N]
    global_tokens: int
    autocast: Callable[[], contextlib.AbstractContextManager]
    # Targets of the step's global batch that count (loss masks); None: all global_tokens of them.
    counted_tokens: int | None = None
    # When a dict: each micro-batch's per-sequence cross-entropy sums [B] are kept under its index (a
    # mixture's loss per source is formed from them after the step).
    sequence_sums: dict[int, torch.Tensor] | None = None

    def aux_share(self, aux: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The aux loss weighted by this micro-batch's share of the step's tokens."""
        return aux.float() * (targets.numel() / self.global_tokens)

    def of(
        self, logits: torch.Tensor, aux: torch.Tensor, targets: torch.Tensor, mb: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate, its cross-entropy part) of micro-batch `mb`."""
        counted = self.global_tokens if self.counted_tokens is None else max(1, self.counted_tokens)
        per_token = self.token_loss(logits, targets)
        if self.sequence_sums is not None:
            self.sequence_sums[mb] = per_token.detach().view(targets.shape[0], -1).sum(1)
        ce = per_token.sum() / counted
        return ce + self.aux_share(aux, targets), ce
