"""Multi-token prediction (DeepSeek-V3's report, DeepSeek-AI 2024, sec. 2.2): D sequential modules after
the main model, depth k predicting the token k + 1 places after each position.

  depth k     h'ₖ = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k−1})])   (h₀: the main model's last block output)
              hₖ = one transformer block(h'ₖ)                       (attention causal over the positions)
              logits of t_{i+k+1} = head(norm(hₖ))                  (the main model's embedding and head)
  loss        main cross-entropy + λ/D · Σₖ depth k's cross-entropy, every term divided by the step's
              counted targets (the report's 1/T), so any layout gives the same loss

The embedding goes first in the concatenation, as DeepSeek's shipped modules (layer num_hidden_layers of
the checkpoint: enorm, hnorm, eh_proj, shared_head) are laid out and as Megatron-Core and vLLM read them.
Depth k at position i needs t_{i+k} and targets t_{i+k+1}: the micro-batch loop shifts the whole sequences
by k before context parallel cuts them (train/micro_batches.py); the last k positions of a window have no
such token and their targets are ignored, as are targets whose input t_{i+k} lies in another document than
position i under a document mask (data.document_mask) and loss-masked ones. Decoding (`meshtron
generate`) does not run the modules: they train the main model's representations; speculative decoding
with them is left to inference engines.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from meshtron.config.schema import ModelConfig
from meshtron.data import IGNORE_INDEX
from meshtron.models.layers import RMSNorm


class MTPModule(nn.Module):
    """One depth: its norms, projection, transformer block and final norm (the head is the model's)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self, h_BSD: Tensor, embedded_BSD: Tensor, cos: Tensor, sin: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(hₖ, norm(hₖ) for the head, the block's MoE aux loss or None) from h_{k−1} and the embedded
        tokens k places on. (The final norm runs here, inside the module's forward: a ZeRO-3 unit's
        weights are gathered only while its forward runs.)"""
        x = self.eh_proj(torch.cat([self.enorm(embedded_BSD), self.hnorm(h_BSD)], dim=-1))
        h, aux = self.block(x, cos, sin) if docs_BS is None else self.block(x, cos, sin, None, docs_BS)
        return h, self.norm(h), aux


def shifted(x_BS: Tensor, depth: int, fill: int) -> Tensor:
    """x moved `depth` places to the left, the last `depth` positions set to `fill`."""
    out = torch.roll(x_BS, -depth, dims=1)
    out[:, x_BS.shape[1] - depth :] = fill
    return out


def depth_inputs(
    tokens_BS: Tensor, targets_BS: Tensor, depths: int, docs_BS: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(tokens [D, B, S], targets [D, B, S]) of every depth, from a micro-batch's whole sequences: depth k
    reads t_{i+k} and predicts targets_{i+k} (= t_{i+k+1}); targets without such a token, or (under a
    document mask) with t_{i+k} in another document than position i, are ignored."""
    tokens, targets = [], []
    for k in range(1, depths + 1):
        t_k = shifted(targets_BS, k, IGNORE_INDEX)
        if docs_BS is not None:
            t_k = t_k.masked_fill(shifted(docs_BS, k, -1) != docs_BS, IGNORE_INDEX)
        tokens.append(shifted(tokens_BS, k, 0))
        targets.append(t_k)
    return torch.stack(tokens), torch.stack(targets)
