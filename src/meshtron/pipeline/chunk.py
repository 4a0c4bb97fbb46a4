"""A pipeline rank's model chunks: which of the model's modules each chunk holds, and a chunk's forward.

The layers of chunk c are `layer_split[c]` (schedules/balance.py); the first chunk holds the embedding,
the last the final norm, the head and the multi-token prediction modules, and the embedding again when
the head is tied to it or the MTP depths embed tokens (their two copies take one gradient:
runtime.py's `sum_tied_gradients`).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.llama import Transformer, output_logits, predict_ahead
from meshtron.models.rope import rope_cos_sin


def keep_rank_chunks(model: Transformer, chunks: list[int], layer_split: list[list[int]]) -> None:
    """Delete every block, and the embedding / final norm / head / MTP modules, that none of `chunks`
    uses. The last chunk keeps the embedding module when the head is tied to it (its weight is the head's)
    or multi-token prediction embeds the tokens ahead there (models/mtp.py)."""
    last = len(layer_split) - 1
    keep = {str(i) for c in chunks for i in layer_split[c]}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if 0 not in chunks and not (shares_embedding(model.cfg) and last in chunks):
        model.tok_embeddings = None
    if last not in chunks:
        model.norm = None
        model.output = None
        model.mtp = None


def shares_embedding(cfg: ModelConfig) -> bool:
    """Whether the last chunk needs the embedding too: as the tied head, or for the MTP depths' tokens.
    Under pipeline parallel its two copies then take one gradient (`sum_tied_gradients`)."""
    return cfg.tie_embeddings or cfg.mtp_depth > 0


class PipelineChunk(nn.Module):
    """One model chunk: a run of the model's blocks, with the embedding in front when it is the first
    chunk and the final norm and head behind when it is the last (the model's own modules, grouped)."""

    def __init__(self, model: Transformer, index: int, layers: list[int], n_chunks: int):
        super().__init__()
        self.index = index
        self.is_first, self.is_last = index == 0, index == n_chunks - 1
        self.blocks = nn.ModuleList([model.layers[str(i)] for i in layers])
        embeds = self.is_first or (self.is_last and shares_embedding(model.cfg))
        self.tok_embeddings = model.tok_embeddings if embeds else None
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.mtp = model.mtp if self.is_last else None
        self.rope_inv_freq, self.rope_factor = model.rope_inv_freq, model.rope_factor

    def forward(
        self,
        x: torch.Tensor,
        positions_BS: torch.Tensor,
        docs_BS: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """(tokens [B, S] or activations [B, S, D]) -> (activations, or logits when last; summed MoE aux).
        `docs_BS`: each token's document, when attention stays within documents; `mtp_tokens` [D, B, S]:
        the last chunk runs the MTP depths too and returns every depth's logits after the main ones."""
        h = self.tok_embeddings(x) if self.is_first else x
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions_BS, h.dtype, self.rope_factor)
        aux = torch.zeros((), device=h.device)
        for block in self.blocks:
            h, block_aux = block(h, cos, sin) if docs_BS is None else block(h, cos, sin, None, docs_BS)
            if block_aux is not None:
                aux = aux + block_aux
        if not self.is_last:
            return h, aux
        logits = output_logits(h, self.norm, self.output, self.tok_embeddings)
        if mtp_tokens is None or self.mtp is None:
            return logits, aux
        depths, mtp_aux = predict_ahead(self.mtp, h, mtp_tokens, self, (cos, sin, docs_BS))
        return (logits, *depths), aux + mtp_aux

    def holds_non_block_params(self) -> bool:
        return self.is_first or self.is_last
