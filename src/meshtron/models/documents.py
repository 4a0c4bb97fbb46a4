"""Packed windows as documents: which document each token belongs to, and its position inside it.

A prepared dataset separates documents with the end-of-document token, which belongs to the document it
ends. In a window of tokens x[0..S):

  document id    d[t] = the number of end tokens strictly before t (so an end token shares its
                 document's id, and the token after it starts the next)
  position       p[t] = t − (the first position of t's document in the window): RoPE restarts at 0 at
                 every document start (a document cut by the window's start begins at 0 too)

Attention under `data.document_mask` lets position i see position j when j ≤ i and d[j] = d[i]
(models/llama.py `document_causal_mask`), so each document is computed as if it were alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class MicroBatchLayout(NamedTuple):
    """What a micro-batch's forward needs beside its tokens (each of this rank's tokens, under cp)."""

    rope: torch.Tensor | None  # RoPE positions [B, S]; None: 0..S-1
    docs: torch.Tensor | None  # document ids of the whole window [B, S]; None without a document mask
    mtp_tokens: torch.Tensor | None = None  # [D, B, S]: what each multi-token prediction depth embeds
    mtp_targets: torch.Tensor | None = None  # [D, B, S]: ...and predicts (models/mtp.py)


def document_layout(tokens_BS: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, S] restarting at each document, document ids [B, S]) of a window of tokens."""
    ends = (tokens_BS == eos_id).long()
    docs = torch.cumsum(ends, dim=1) - ends
    index = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
    starts = torch.ones_like(ends, dtype=torch.bool)
    starts[:, 1:] = ends[:, :-1].bool()
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first, docs


@dataclass(frozen=True)
class DocumentMask:
    """`data.document_mask`: attention within documents, RoPE positions restarting at each (unless
    `reset_positions` is off)."""

    eos_id: int
    reset_positions: bool = True

    def layout(
        self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the RoPE positions, the document ids) of a micro-batch's tokens; `positions_BS` are its
        positions in the window (kept when positions are not reset)."""
        reset, docs = document_layout(tokens_BS, self.eos_id)
        return (reset if self.reset_positions else positions_BS), docs
