"""Grouped-query attention (Llama, Mistral, Qwen) and the causal attention both attention kinds call.

  Attention   wq, wk, wv, wo with H query heads and K key/value heads (H = K·G), optional q/k/v biases
              (Qwen2) and per-head q/k RMSNorm (Qwen3), rotary embedding on the whole head
  attend      causal attention of rotated q [B, H, S, Dh] over k [B, K, S, Dh] and v [B, K, S, Dv]:
              PyTorch's SDPA, or under a document mask on the CPU the blockwise path (no [S, S] mask);
              context parallel replaces an attention's `attend` with an exchange (parallel/context.py).
              Values narrower than the keys (MLA's) are padded with zeros for SDPA, whose fused kernels
              (flash, on the CPU and on GPUs) take one head size; its math fallback would keep the
              [S, S] scores

The part between the projections that selective recompute reruns is each attention's `core` (rotary
embedding + attend). For decoding, `forward` takes the layer's cache (LayerKV here); training never
passes one, so its path is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshtron.config.schema import ModelConfig
from meshtron.models.blockwise_attention import attend_blockwise
from meshtron.models.layers import RMSNorm
from meshtron.models.rope import apply_rope


def document_causal_mask(docs_BS: Tensor, window: int = 0) -> Tensor:
    """[B, 1, S, S]: position i sees j when j <= i, both in one document (and i - j < window, if set)."""
    i = torch.arange(docs_BS.shape[1], device=docs_BS.device)
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & (distance < window) if window else distance >= 0
    return (allowed & (docs_BS[:, :, None] == docs_BS[:, None, :]))[:, None]


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    docs_BS: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of q [B, H, S, Dh] over k [B, K, S, Dh], v [B, K, S, Dv]; with `docs_BS`, within
    each document of a packed window (models/documents.py); `window`: a sliding window (0: none);
    `scale`: the logits' scale (None: 1/sqrt(Dh))."""
    S, Dv = q.shape[2], v.shape[-1]
    gqa = q.shape[1] != k.shape[1]
    if docs_BS is not None and q.device.type == "cpu":  # no [S, S] mask: tiles skip other documents
        return attend_blockwise(q, k, v, docs_BS, window, scale)
    if Dv < q.shape[-1]:  # MLA: the fused (flash) kernels take one head size; zero value dims add nothing
        return causal_attention(q, k, F.pad(v, (0, q.shape[-1] - Dv)), docs_BS, window, scale)[..., :Dv]
    if docs_BS is not None:
        mask = document_causal_mask(docs_BS, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    if window and S > window:
        i = torch.arange(S, device=q.device)
        distance = i[:, None] - i[None, :]
        allowed = (distance >= 0) & (distance < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)


def cached_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
) -> Tensor:
    """The queries of the new tokens (at positions start onwards) over every cached key, themselves
    included. The mask is explicit: SDPA's is_causal aligns a short query block with the first keys,
    not the last, and the sliding window counts from each query's own position."""
    q_pos = torch.arange(start, start + q.shape[2], device=q.device)
    distance = q_pos[:, None] - torch.arange(keys.shape[2], device=q.device)[None, :]
    allowed = distance >= 0
    if window:
        allowed &= distance < window
    gqa = q.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=gqa, scale=scale)


class LayerKV:
    """One layer's cached keys and values [B, K, max_len, Dh], filled up to `length`."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype):
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k_BKSDh: Tensor, v_BKSDh: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' (rotated) keys and values; returns every cached one so far."""
        end = self.length + k_BKSDh.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"the KV cache holds {self.keys.shape[2]} tokens; {end} were asked for")
        self.keys[:, :, self.length : end] = k_BKSDh
        self.values[:, :, self.length : end] = v_BKSDh
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """What one token costs in one layer's cache: its keys and values of every key/value head."""
        return 2 * cfg.kv_heads * cfg.head_size * torch.tensor([], dtype=dtype).element_size()


class Attention(nn.Module):
    """Grouped-query attention; `scale` None: the logits' default 1/sqrt(Dh)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.sliding_window, self.scale = cfg.sliding_window, None
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: LayerKV | None = None,
        docs_BS: Tensor | None = None,
    ) -> Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qkv = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            out_BHSDh = self.cached_core(*qkv, cos, sin, cache)
        else:  # (documents: an argument, so that a recompute reruns the core with the same mask)
            out_BHSDh = self.core(*qkv, cos, sin) if docs_BS is None else self.core(*qkv, cos, sin, docs_BS)
        return self.wo(out_BHSDh.transpose(1, 2).reshape(B, S, -1))

    def core(
        self,
        q_BHSDh: Tensor,
        k_BKSDh: Tensor,
        v_BKSDh: Tensor,
        cos: Tensor,
        sin: Tensor,
        docs_BS: Tensor | None = None,
    ) -> Tensor:
        """Rotary embedding and attention: the part selective recompute recomputes in backward."""
        q, k = apply_rope(q_BHSDh, cos, sin), apply_rope(k_BKSDh, cos, sin)
        return self.attend(q, k, v_BKSDh, docs_BS)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, docs_BS: Tensor | None = None) -> Tensor:
        """`causal_attention` with this layer's window; context parallel replaces it on the instance."""
        return causal_attention(q, k, v, docs_BS, self.sliding_window)

    def cached_core(
        self, q_BHSDh: Tensor, k_BKSDh: Tensor, v_BKSDh: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV
    ) -> Tensor:
        """The S new tokens (at positions cache.length onwards, which cos/sin carry) over the cached
        ones and themselves."""
        start = cache.length
        keys, values = cache.extend(apply_rope(k_BKSDh, cos, sin), v_BKSDh)
        return cached_attention(apply_rope(q_BHSDh, cos, sin), keys, values, start, self.sliding_window)
