"""Llama-family decoder: RMSNorm, RoPE (with llama3 scaling), grouped-query attention, SwiGLU.

Covers Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm); MoE layers come from
`moe.py`. For decoding, `forward` takes an optional `KVCache` (keys and values of the tokens already
seen); training never passes one, so its path is unchanged. Shapes in names: B batch, S sequence,
D model dim, H query heads, K key/value heads, Dh head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.blockwise_attention import attend_blockwise
from meshtron.models.init import init_weights
from meshtron.models.layers import FeedForward, RMSNorm
from meshtron.models.moe import MoE


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [Dh/2], with Llama 3.1's piecewise frequency scaling when asked for."""
    dim = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, old_len = cfg.rope_scaling_factor, cfg.rope_original_max_position
    low_wavelen = old_len / cfg.rope_low_freq_factor
    high_wavelen = old_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape [B, S, Dh] for explicit positions [B, S]: a rank may hold any chunk of a sequence."""
    angles = positions[..., None].float() * inv_freq.float()
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BHSDh: torch.Tensor, cos_BSDh: torch.Tensor, sin_BSDh: torch.Tensor) -> torch.Tensor:
    half = x_BHSDh.shape[-1] // 2
    rotated = torch.cat([-x_BHSDh[..., half:], x_BHSDh[..., :half]], dim=-1)
    return x_BHSDh * cos_BSDh[:, None] + rotated * sin_BSDh[:, None]


class LayerKV:
    """One layer's cached keys and values [B, K, max_len, Dh], filled up to `length`."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype):
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k_BKSDh: torch.Tensor, v_BKSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' (rotated) keys and values; returns every cached one so far."""
        end = self.length + k_BKSDh.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"the KV cache holds {self.keys.shape[2]} tokens; {end} were asked for")
        self.keys[:, :, self.length : end] = k_BKSDh
        self.values[:, :, self.length : end] = v_BKSDh
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's keys and values for decoding, preallocated for `max_len` tokens (prompt + new), so
    a step appends in place instead of concatenating the whole history again."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
        self.layers = {str(i): LayerKV(shape, device, dtype) for i in range(cfg.n_layers)}

    @property
    def length(self) -> int:
        """Tokens cached so far: the position the next token takes."""
        return next(iter(self.layers.values())).length if self.layers else 0


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.sliding_window = cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        docs_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
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
        q_BHSDh: torch.Tensor,
        k_BKSDh: torch.Tensor,
        v_BKSDh: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary embedding and attention: the part selective recompute recomputes in backward."""
        q, k = apply_rope(q_BHSDh, cos, sin), apply_rope(k_BKSDh, cos, sin)
        return self.attend(q, k, v_BKSDh, docs_BS)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs_BS: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of rotated q [B, H, S, Dh] over k, v [B, K, S, Dh]; with `docs_BS`, within
        each document of a packed window (models/documents.py). Context parallel replaces it on the
        instance with an exchange over the ranks that hold the rest of the sequence."""
        S = q.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if docs_BS is not None and q.device.type == "cpu":  # no [S, S] mask: tiles skip other documents
            return attend_blockwise(q, k, v, docs_BS, self.sliding_window)
        if docs_BS is not None:
            mask = document_causal_mask(docs_BS, self.sliding_window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if self.sliding_window and S > self.sliding_window:
            i = torch.arange(S, device=q.device)
            distance = i[:, None] - i[None, :]
            allowed = (distance >= 0) & (distance < self.sliding_window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def cached_core(
        self,
        q_BHSDh: torch.Tensor,
        k_BKSDh: torch.Tensor,
        v_BKSDh: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV,
    ) -> torch.Tensor:
        """The S new tokens (at positions cache.length onwards, which cos/sin carry) over the cached
        ones and themselves. The mask is explicit: SDPA's is_causal aligns a short query block with the
        first keys, not the last, and the sliding window counts from each query's own position."""
        start = cache.length
        keys, values = cache.extend(apply_rope(k_BKSDh, cos, sin), v_BKSDh)
        q_pos = torch.arange(start, start + q_BHSDh.shape[2], device=q_BHSDh.device)
        distance = q_pos[:, None] - torch.arange(keys.shape[2], device=q_BHSDh.device)[None, :]
        allowed = distance >= 0
        if self.sliding_window:
            allowed &= distance < self.sliding_window
        q = apply_rope(q_BHSDh, cos, sin)
        gqa = q.shape[1] != keys.shape[1]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=gqa)


def document_causal_mask(docs_BS: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[B, 1, S, S]: position i sees j when j <= i, both in one document (and i - j < window, if set)."""
    i = torch.arange(docs_BS.shape[1], device=docs_BS.device)
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & (distance < window) if window else distance >= 0
    return (allowed & (docs_BS[:, :, None] == docs_BS[:, None, :]))[:, None]


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer_id):
            self.moe: MoE | None = MoE(cfg)
            self.feed_forward: FeedForward | None = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        docs_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, cache, docs_BS)
        if self.moe is None:
            return h + self.feed_forward(self.ffn_norm(h)), None
        moe_out, aux_loss = self.moe(self.ffn_norm(h))
        return h + moe_out, aux_loss


class Transformer(nn.Module):
    """Decoder-only language model. `forward(tokens)` returns logits [B, S, V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        return_aux: bool = False,
        cache: KVCache | None = None,
        docs_BS: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, S, V]; with return_aux also the summed MoE auxiliary loss (0 for dense models).
        With a cache, the tokens follow those it holds (positions offset by its length) and join it.
        `docs_BS`: each token's document (models/documents.py): attention stays within documents."""
        if positions_BS is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + tokens_BS.shape[1], device=tokens_BS.device)
            positions_BS = positions.expand_as(tokens_BS)
        h = self.tok_embeddings(tokens_BS)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions_BS, h.dtype)
        aux_loss = torch.zeros((), device=h.device)
        for name, block in self.layers.items():
            # Blocks are called as the pipeline runtime and recompute wrappers expect when not decoding.
            if cache is not None:
                h, block_aux = block(h, cos, sin, cache.layers[name])
            else:
                h, block_aux = block(h, cos, sin) if docs_BS is None else block(h, cos, sin, None, docs_BS)
            if block_aux is not None:
                aux_loss = aux_loss + block_aux
        logits = output_logits(h, self.norm, self.output, self.tok_embeddings)
        return (logits, aux_loss) if return_aux else logits

    def reset_buffers(self, device: torch.device) -> None:
        """The buffers' initial values on `device` (after a build on the meta device)."""
        self.rope_inv_freq = rope_inv_freq(self.cfg).to(device)
        for block in self.layers.values():
            if block.moe is not None:
                block.moe.reset_buffers(device)

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - self.tok_embeddings.weight.numel() if exclude_embedding else total


def output_logits(
    h_BSD: torch.Tensor, norm: nn.Module, output: nn.Module | None, tok_embeddings: nn.Module
) -> torch.Tensor:
    """Final norm, then the output head, or the embedding matrix when the two are tied."""
    h_BSD = norm(h_BSD)
    return F.linear(h_BSD, tok_embeddings.weight) if output is None else output(h_BSD)


def build_model(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> Transformer:
    """A single-device model with layout-independent initial weights (init.py)."""
    model = Transformer(cfg)
    init_weights(model, cfg, seed)
    return model.to(device)


def build_meta_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """The model's structure with its parameters on the meta device (shapes, no storage) and its buffers
    on `device`: what `parallelize` cuts before each rank materialises only the parameters it holds."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.reset_buffers(torch.device(device))
    return model
