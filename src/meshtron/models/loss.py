"""The training loss of a micro-batch, as every layout forms it.

Each micro-batch's cross-entropy is summed over its tokens and divided by the *global* token count of
the step (all micro-batches of all data-parallel ranks; with a loss mask, the targets of the global
batch that count, which every rank reads from the data), and an MoE model's aux loss (a mean over the
micro-batch's tokens) is weighted by the micro-batch's share of all the step's tokens. Summing the micro-batches'
losses over a step and over the data-parallel ranks then gives the mean over the global batch, so no
layout ever averages gradients, and any layout computes the same update. With multi-token prediction
(models/mtp.py) each depth's summed cross-entropy is divided by the same count and the depths' sum
weighted by training.mtp_loss_coef / D (DeepSeek-V3's λ/D · Σₖ with its 1/T).
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


@dataclass(frozen=True)
class MicroBatchLoss:
    """How each micro-batch's loss is formed in a job, and the autocast its forward runs under: built
    once, at set-up; each step's own divisor makes a `StepLoss` of it (`for_step`)."""

    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # per-token cross-entropy [N]
    global_tokens: int  # the tokens of a step's global batch
    autocast: Callable[[], contextlib.AbstractContextManager]
    mtp_coef: float = 0.0  # λ of multi-token prediction (its depths' losses weigh λ/D each)

    def for_step(
        self,
        counted_tokens: int | None,
        sequence_sums: dict[int, torch.Tensor] | None = None,
        mtp_sums: dict[int, torch.Tensor] | None = None,
        share_tokens: int | None = None,
    ) -> StepLoss:
        """This loss in one step. `counted_tokens`: the targets of the step's global batch that count
        (loss masks; None: all global_tokens of them). `sequence_sums`: when a dict, each micro-batch's
        per-sequence cross-entropy sums [B] are kept in it under its index (a mixture's loss per source is
        formed from them after the step); `mtp_sums` likewise each micro-batch's MTP cross-entropy [D]
        over the divisor (for the metrics). `share_tokens`: the tokens the auxiliary losses are shared over
        (None: the global batch's; a DiLoCo replica: its own share of it)."""
        divisor = self.global_tokens if counted_tokens is None else max(1, counted_tokens)
        return StepLoss(self, divisor, sequence_sums, mtp_sums, share_tokens or self.global_tokens)


@dataclass(frozen=True)
class StepLoss:
    """The loss of each micro-batch of one step: the job's `MicroBatchLoss` with the step's divisor."""

    job_loss: MicroBatchLoss
    divisor: int  # what each micro-batch's summed cross-entropy is divided by: the step's counted targets
    sequence_sums: dict[int, torch.Tensor] | None = None  # (MicroBatchLoss.for_step)
    mtp_sums: dict[int, torch.Tensor] | None = None  # (MicroBatchLoss.for_step)
    share_tokens: int = 0  # the tokens the aux losses are shared over (MicroBatchLoss.for_step)

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.job_loss.autocast()

    def aux_share(self, aux: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The aux loss weighted by this micro-batch's share of the step's tokens."""
        return aux.float() * (targets.numel() / (self.share_tokens or self.job_loss.global_tokens))

    def of(
        self,
        logits: torch.Tensor | tuple[torch.Tensor, ...],
        aux: torch.Tensor,
        targets: torch.Tensor,
        mb: int = 0,
        mtp_targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate, its main cross-entropy part) of micro-batch `mb`. `logits`: the
        main model's, or (with multi-token prediction) a tuple of it and each depth's, whose targets are
        `mtp_targets` [D, B, S]."""
        main, *depths = logits if isinstance(logits, tuple) else (logits,)
        per_token = self.job_loss.token_loss(main, targets)
        if self.sequence_sums is not None:
            self.sequence_sums[mb] = per_token.detach().view(targets.shape[0], -1).sum(1)
        ce = per_token.sum() / self.divisor
        total = ce + self.aux_share(aux, targets)
        if depths and mtp_targets is not None:
            depth_ce = (
                torch.stack(
                    [self.job_loss.token_loss(lg, t).sum() for lg, t in zip(depths, mtp_targets, strict=True)]
                )
                / self.divisor
            )
            if self.mtp_sums is not None:
                self.mtp_sums[mb] = depth_ce.detach()
            total = total + depth_ce.sum() * (self.job_loss.mtp_coef / len(depths))
        return total, ce
