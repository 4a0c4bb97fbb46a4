"""Llama-family decoder: RMSNorm, RoPE (with llama3 scaling), grouped-query attention, SwiGLU.

Covers Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm); MoE layers come from
`moe.py`. Shapes in names: B batch, S sequence, D model dim, H query heads, K key/value heads,
Dh head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig, divisors
from meshtron.models.layers import FeedForward, RMSNorm
from meshtron.models.moe import MoE


def model_problems(cfg: ModelConfig) -> list[str]:
    """What the attention and rotary embedding need of the model's sizes."""
    problems = []
    if cfg.head_dim == 0 and cfg.dim % cfg.n_heads:
        problems.append(
            f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}; "
            f"use n_heads in {divisors(cfg.dim)} or set model.head_dim"
        )
    if cfg.head_size % 2:
        problems.append(
            f"head size {cfg.head_size} must be even for rotary embeddings; change model.dim, "
            "model.n_heads or model.head_dim"
        )
    if cfg.n_heads % cfg.kv_heads:
        problems.append(
            f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.n_kv_heads}; "
            f"use n_kv_heads in {divisors(cfg.n_heads)}"
        )
    if cfg.rope_scaling == "llama3" and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        problems.append(
            "model.rope_high_freq_factor must exceed model.rope_low_freq_factor for llama3 scaling"
        )
    return problems


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

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out_BHSDh = self.core(*(t.transpose(1, 2) for t in (q, k, v)), cos, sin)
        return self.wo(out_BHSDh.transpose(1, 2).reshape(B, S, -1))

    def core(
        self,
        q_BHSDh: torch.Tensor,
        k_BKSDh: torch.Tensor,
        v_BKSDh: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary embedding and attention: the part selective recompute recomputes in backward."""
        return self.attend(apply_rope(q_BHSDh, cos, sin), apply_rope(k_BKSDh, cos, sin), v_BKSDh)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of rotated q [B, H, S, Dh] over k, v [B, K, S, Dh]. Context parallel replaces
        it on the instance with an exchange over the ranks that hold the rest of the sequence."""
        S = q.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if self.sliding_window and S > self.sliding_window:
            i = torch.arange(S, device=q.device)
            distance = i[:, None] - i[None, :]
            allowed = (distance >= 0) & (distance < self.sliding_window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


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
        self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin)
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
        self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor | None = None, return_aux: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, S, V]; with return_aux also the summed MoE auxiliary loss (0 for dense models)."""
        if positions_BS is None:
            positions_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
        h = self.tok_embeddings(tokens_BS)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions_BS, h.dtype)
        aux_loss = torch.zeros((), device=h.device)
        for block in self.layers.values():
            h, block_aux = block(h, cos, sin)
            if block_aux is not None:
                aux_loss = aux_loss + block_aux
        logits = output_logits(h, self.norm, self.output, self.tok_embeddings)
        return (logits, aux_loss) if return_aux else logits

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - self.tok_embeddings.weight.numel() if exclude_embedding else total


def output_logits(
    h_BSD: torch.Tensor, norm: nn.Module, output: nn.Module | None, tok_embeddings: nn.Module
) -> torch.Tensor:
    """Final norm, then the output head, or the embedding matrix when the two are tied."""
    h_BSD = norm(h_BSD)
    return F.linear(h_BSD, tok_embeddings.weight) if output is None else output(h_BSD)


def parameter_seed(seed: int, name: str) -> int:
    """A seed per logical parameter, so every layout draws the same values for it before slicing."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_parameter(name: str, param: torch.Tensor, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full logical value of parameter `name` (any parallel layout slices this same tensor)."""
    *_, owner, leaf = ("",) + tuple(name.split("."))
    if "norm" in owner:
        return torch.ones(param.shape)
    if leaf == "bias":
        return torch.zeros(param.shape)
    std = cfg.init_std
    if owner in ("wo", "w2") or name.endswith("experts.w2"):
        std = std / math.sqrt(2 * cfg.n_layers)  # residual-branch outputs, as in GPT-2
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.randn(param.shape, generator=generator, dtype=torch.float32) * std


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    for name, param in model.named_parameters():
        param.copy_(init_parameter(name, param, cfg, seed))


def build_model(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> Transformer:
    """A single-device model with layout-independent initial weights."""
    model = Transformer(cfg)
    init_weights(model, cfg, seed)
    return model.to(device)
