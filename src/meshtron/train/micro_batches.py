"""A step's micro-batches through this rank's part of the model: the training step's and evaluation's loop.

  1  layouts     each micro-batch's RoPE positions and document ids, from its whole sequences [B, S]:
                 under cp the document ids stay whole (attention looks up those of the positions other
                 ranks hold, parallel/context.py), the positions are this rank's [B, S/cp]; every rank and
                 pipeline stage forms them from the tokens it holds, so nothing more travels; with
                 multi-token prediction each depth's tokens and targets too, shifted on the whole
                 sequences before cp cuts them (models/mtp.py)
  2  local       under cp, this rank's tokens and targets of each sequence (all of them without cp)
  3  run         under pp the runtime's schedule order (pipeline/runtime.py); else one after another:
                 `before_grads(is_last)`, forward under the loss's autocast, the loss, backward
  4  gradients   after the last backward (`finish_gradients`): every reduction waited for, and the two
                 copies of a tied (or MTP-shared) embedding summed over the pipeline's ends (so they take
                 the same step)

The loss of each micro-batch is the step's `StepLoss` (models/loss.py): the job's loss with the step's
divisor, the targets that count in the whole global batch, so summing over micro-batches and ranks gives
the global mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtron.comm.timing import TIMES
from meshtron.models.documents import DocumentMask, MicroBatchLayout
from meshtron.models.loss import StepLoss
from meshtron.models.mtp import depth_inputs
from meshtron.parallel.parallelize import ParallelModel
from meshtron.pipeline.runtime import sum_tied_gradients

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]  # (tokens [B, S], targets [B, S]) each


def local_sequence(positions: torch.Tensor | None, x_BS: torch.Tensor) -> torch.Tensor:
    """This rank's tokens (or labels) of each sequence [..., B, S], at `positions` [S/cp]; all of them
    without cp."""
    if positions is None:
        return x_BS
    return x_BS[..., positions.to(x_BS.device)].contiguous()


def micro_batch_layout(
    positions: torch.Tensor | None,
    documents: DocumentMask | None,
    tokens_BS: torch.Tensor,
    targets_BS: torch.Tensor | None = None,
    mtp_depth: int = 0,
) -> MicroBatchLayout:
    """The RoPE positions [B, S/cp] of this rank's tokens (None for 0..S-1), the document ids [B, S] (or
    None) and, with `mtp_depth`, what each multi-token prediction depth embeds and predicts [D, B, S/cp]
    (models/mtp.py), of a micro-batch's whole sequences. `positions`: the global positions [S/cp] this
    rank holds under cp (ParallelModel.positions); `documents`: data.document_mask's, or None."""
    rope, docs = None, None
    if documents is not None:
        window = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
        rope, docs = documents.layout(tokens_BS, window)
        rope = local_sequence(positions, rope)
    elif positions is not None:
        rope = positions.to(tokens_BS.device).expand(tokens_BS.shape[0], -1)
    if not mtp_depth or targets_BS is None:
        return MicroBatchLayout(rope, docs)
    tokens_DBS, targets_DBS = depth_inputs(tokens_BS, targets_BS.to(tokens_BS.device), mtp_depth, docs)
    return MicroBatchLayout(
        rope, docs, local_sequence(positions, tokens_DBS), local_sequence(positions, targets_DBS)
    )


def run_micro_batches(
    parallel: ParallelModel,
    micro_batches: MicroBatches,
    loss: StepLoss,
    *,
    device: torch.device,
    documents: DocumentMask | None = None,
    backward: bool = True,
    before_grads: Callable[[bool], None] = lambda is_last: None,
) -> torch.Tensor:
    """Steps 1-3 above over one step's micro-batches (whole sequences). Returns this rank's share of the
    summed cross-entropy (under pp, non-zero on the last stage only). Evaluation (not `backward`) leaves
    the multi-token prediction depths out: its loss is the main model's."""
    depth = parallel.model.cfg.mtp_depth if backward else 0
    layouts = [
        micro_batch_layout(parallel.positions, documents, x.to(device), y, depth) for x, y in micro_batches
    ]
    local = [
        (local_sequence(parallel.positions, x).to(device), local_sequence(parallel.positions, y).to(device))
        for x, y in micro_batches
    ]
    if parallel.pipeline is not None:
        if not backward:
            return parallel.pipeline.forward_only(local, loss, layouts)
        chunk_backward = parallel.engine.chunk_backward
        return parallel.pipeline.run(local, loss, before_grads, layouts, chunk_backward=chunk_backward)
    ce_sum = torch.zeros((), device=device)
    for index, ((inputs, targets), layout) in enumerate(zip(local, layouts, strict=True)):
        if backward:
            before_grads(index == len(local) - 1)
        with TIMES.phase("forward", f"forward micro-batch {index}"):
            with loss.autocast():
                logits, aux = parallel.model(
                    inputs, layout.rope, return_aux=True, docs_BS=layout.docs, mtp_tokens=layout.mtp_tokens
                )
            total, ce = loss.of(logits, aux, targets, index, layout.mtp_targets)
        del logits  # backward needs the loss's log-probabilities, not these: tokens x vocab freed now
        if backward:
            with TIMES.phase("backward", f"backward micro-batch {index}"):
                total.backward()
        ce_sum += ce.detach()
    return ce_sum


def finish_gradients(parallel: ParallelModel) -> None:
    """Step 4 above, after the step's last backward."""
    parallel.engine.finish_gradients()
    if parallel.tied_ends is not None:
        sum_tied_gradients(parallel.engine, parallel.comm, parallel.tied_ends)
