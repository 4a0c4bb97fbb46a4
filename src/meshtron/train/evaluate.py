"""The validation loss: forwards only, on the model as the layout holds it, equal to one device's value.

Every rank runs the forward of its part of the model (tensor-, context-, expert-parallel shards, ZeRO-3's
gathered units, its pipeline stage) over its slice of each validation batch, exactly as a training step
does but without gradients; the loss is the training loss's cross-entropy (each token's, summed and
divided by the evaluated token count), summed over the pipeline (only the last stage holds it) and over the
data- and context-parallel ranks (which hold the other sequences and tokens), so every layout computes the
mean over the same tokens as one device does. The MoE auxiliary losses are left out (they are training
signals, not a measure of the model), and expert loads are not counted (they describe training batches).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from meshtron.comm.group import CommGroup
from meshtron.config.layout import Dim
from meshtron.config.schema import TrainingConfig
from meshtron.data.dataset import PreparedData
from meshtron.data.mixture import MixtureSampler
from meshtron.data.validation import validation_sampler
from meshtron.models.documents import DocumentMask
from meshtron.models.loss import MicroBatchLoss
from meshtron.models.moe import loads_not_counted
from meshtron.parallel.parallelize import ParallelModel
from meshtron.train.micro_batches import run_micro_batches

if TYPE_CHECKING:
    from meshtron.train.setup import RankPlace


class Evaluator:
    """The validation batches of one job and the forward-only loss over them."""

    def __init__(
        self,
        parallel: ParallelModel,
        val: PreparedData,
        training: TrainingConfig,
        train_loss: MicroBatchLoss,
        place: RankPlace,
        dp: CommGroup,
        dp_cp: CommGroup,
        documents: DocumentMask | None = None,
    ):
        """`train_loss`: the training step's loss, whose per-token loss and autocast evaluation shares;
        `dp`, `dp_cp`: the groups that split the batch (and, with cp, its sequences); `documents`:
        data.document_mask's, as training attends."""
        self.parallel, self.val, self.training, self.place = parallel, val, training, place
        self.dp, self.dp_cp, self.documents = dp, dp_cp, documents
        self.sampler = validation_sampler(training, val)
        self.tokens = training.eval_batches * training.global_batch * training.seq_len
        self.loss = MicroBatchLoss(train_loss.token_loss, self.tokens, train_loss.autocast)
        counted = [self.sampler.counted_targets(val, index) for index in range(training.eval_batches)]
        self.counted = None if None in counted else sum(counted)  # (loss masks: the targets that count)
        self.counted_by_source = (  # a mixture's: the same batches' counted targets per source
            sum(self.sampler.counted_by_source(val, i) for i in range(training.eval_batches))
            if isinstance(self.sampler, MixtureSampler)
            else None
        )

    def due(self, step: int) -> bool:
        """Whether an evaluation follows optimizer step `step` (1-based): every eval_every, and the last."""
        t = self.training
        return t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps)

    @torch.no_grad()
    def loss_sum(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part of the mean validation cross-entropy (the sum over the layout is the mean),
        and for a mixture its cross-entropy sums per source."""
        t, device = self.training, self.place.device
        total = torch.zeros((), device=device)
        mixture = isinstance(self.sampler, MixtureSampler)
        by_source = torch.zeros(len(self.val.sources), dtype=torch.float64) if mixture else None
        for index in range(t.eval_batches):
            batches = self.sampler.micro_batches(self.val, index, self.dp.rank, self.dp.size, t.micro_batch)
            sums: dict[int, torch.Tensor] | None = {} if mixture else None
            loss = self.loss.for_step(self.counted, sums)
            total += run_micro_batches(
                self.parallel, batches, loss, device=device, documents=self.documents, backward=False
            )
            if by_source is not None and sums is not None:
                by_source += self.sampler.source_sums(sums, index, self.dp.rank, self.dp.size, t.micro_batch)
        return total, by_source

    def evaluate(self, step: int) -> dict[str, Any]:
        """Collective over the job: the metrics row of the validation loss after optimizer step `step`."""
        with loads_not_counted():
            total, by_source = self.loss_sum()
        comm = self.place.comm
        row: dict[str, Any] = {"step": step}
        for part in (total, by_source) if by_source is not None else (total,):
            comm.all_reduce_(part, self.place.mesh.group(Dim.PP))
            comm.all_reduce_(part, self.dp_cp)
        if by_source is not None:  # each source's mean over its own counted targets
            counted = self.counted_by_source
            row["val_loss_by_source"] = {
                n: float(s / c)
                for n, s, c in zip(self.val.names, by_source.tolist(), counted, strict=True)
                if c
            }
        loss = float(total)
        return {**row, "val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
