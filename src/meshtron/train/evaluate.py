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
from typing import TYPE_CHECKING

import torch

from meshtron.data.dataset import PreparedData
from meshtron.data.validation import validation_sampler
from meshtron.models.loss import MicroBatchLoss
from meshtron.models.moe import loads_not_counted

if TYPE_CHECKING:
    from meshtron.train.trainer import Trainer


class Evaluator:
    """The validation batches of one job and the forward-only loss over them."""

    def __init__(self, trainer: Trainer, val: PreparedData):
        self.trainer, self.val = trainer, val
        self.sampler = validation_sampler(trainer.cfg, val)
        t = trainer.cfg.training
        self.tokens = t.eval_batches * t.global_batch * t.seq_len
        self.loss = MicroBatchLoss(trainer.parallel.token_loss, self.tokens, trainer.loss.autocast)

    def due(self, step: int) -> bool:
        """Whether an evaluation follows optimizer step `step` (1-based): every eval_every, and the last."""
        t = self.trainer.cfg.training
        return t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps)

    @torch.no_grad()
    def loss_sum(self) -> torch.Tensor:
        """This rank's part of the mean validation cross-entropy (the sum over the layout is the mean)."""
        tr, t = self.trainer, self.trainer.cfg.training
        dp, local, device = tr.dp, tr.parallel.local_sequence, tr.device
        total = torch.zeros((), device=device)
        for index in range(t.eval_batches):
            batches = self.sampler.micro_batches(self.val, index, dp.rank, dp.size, t.micro_batch)
            batches = [(local(x).to(device), local(y).to(device)) for x, y in batches]
            positions = tr.parallel.positions_of(batches[0][0])
            if tr.pipeline is not None:
                total += tr.pipeline.forward_only(batches, self.loss, positions)
                continue
            for inputs, targets in batches:
                with self.loss.autocast():
                    logits, aux = tr.model(inputs, positions, return_aux=True)
                total += self.loss.of(logits, aux, targets)[1]
        return total

    def evaluate(self, step: int) -> dict[str, float]:
        """Collective over the job: the metrics row of the validation loss after optimizer step `step`."""
        tr = self.trainer
        with loads_not_counted():
            total = self.loss_sum()
        tr.comm.all_reduce_(total, tr.place.mesh.group("pp"))
        tr.comm.all_reduce_(total, tr.dp_cp)
        tr.comm.stats.reset()  # the next step's communication is the step's own
        loss = float(total)
        return {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
