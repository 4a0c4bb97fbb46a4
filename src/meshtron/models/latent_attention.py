"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3, 2024).

Keys and values come from one small latent per token instead of per-head projections, so what a token
leaves behind (in a decoding cache, or on a context-parallel ring) is that latent, not every head's keys
and values. With C = kv_lora_rank, R = qk_rope_head_dim, N = qk_nope_head_dim, Dv = v_head_dim, H heads:

  queries    q = wq_b(norm(wq_a(x)))  [H, N + R]       (q_lora_rank > 0; else q = wq(x))
  latent     [c, k_rot] = wkv_a(x)     c [C], k_rot [R]: one rotary key all heads share
             c = norm(c)
  up         [k_nope, v] = wkv_b(c)    [H, N + Dv]
  attention  q = [q_nope, rope(q_rot)], k = [k_nope, rope(k_rot)] per head; softmax scale
             1/sqrt(N + R), times YaRN's mscale² when the context is stretched (models/rope.py)
  out        wo(attention [H·Dv])

The latents' norms keep RMSNorm's eps of 1e-6 (DeepSeek's and transformers' code), whatever the model's
norm_eps. Selective recompute reruns `core`: the rotary embedding, the key assembly and the attention
(the up-projection is kept). Context parallel exchanges either the up-projected keys and values (`attend`
replaced) or the latents themselves (`latent_attend` set: parallel/context_latent.py), which up-projects
each arriving block.

Decoding caches c and the rotated k_rot per token (C + R values per layer, `LatentKV`) and computes with
the absorbed form: wkv_b's key half folded into the queries and its value half into the output, so
attention runs over the cached latents directly, every head sharing them (one key/value head of size
C + R / C) and nothing per head is ever formed for the cached tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.attention import cached_attention, causal_attention
from meshtron.models.layers import RMSNorm
from meshtron.models.rope import apply_rope, softmax_scale

LATENT_NORM_EPS = 1e-6


class LatentKV:
    """One layer's decoding cache: latents [B, max_len, C] and rotated rotary keys [B, 1, max_len, R]."""

    def __init__(
        self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ):
        self.latents = torch.zeros((batch, max_len, cfg.kv_lora_rank), device=device, dtype=dtype)
        self.rotary = torch.zeros((batch, 1, max_len, cfg.qk_rope_head_dim), device=device, dtype=dtype)
        self.length = 0

    def extend(self, c_BSC: torch.Tensor, k_rot_B1SR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' latents and rotated keys; returns every cached one so far."""
        end = self.length + c_BSC.shape[1]
        if end > self.latents.shape[1]:
            raise ValueError(f"the latent cache holds {self.latents.shape[1]} tokens; {end} were asked for")
        self.latents[:, self.length : end] = c_BSC
        self.rotary[:, :, self.length : end] = k_rot_B1SR
        self.length = end
        return self.latents[:, :end], self.rotary[:, :, :end]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """What one token costs in one layer's cache: its latent and its rotary key."""
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * torch.tensor([], dtype=dtype).element_size()


class LatentAttention(nn.Module):
    """MLA (the module docstring). Under tensor parallel the up-projections and wo hold this rank's heads
    (parallel/tensor.py), so every view below reads the head count from the tensors."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, C = cfg.n_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.head_dim, self.kv_rank = self.nope + self.rope, C
        self.sliding_window, self.scale, self.interleaved = (
            cfg.sliding_window,
            softmax_scale(cfg),
            cfg.rope_interleave,
        )
        self.wq = nn.Linear(cfg.dim, H * self.head_dim, bias=False) if not cfg.q_lora_rank else None
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False) if cfg.q_lora_rank else None
        self.q_latent_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS) if cfg.q_lora_rank else None
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * self.head_dim, bias=False) if cfg.q_lora_rank else None
        self.wkv_a = nn.Linear(cfg.dim, C + self.rope, bias=False)
        self.kv_latent_norm = RMSNorm(C, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(C, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        # Context parallel over the latents: (q, latents, rotated k_rot, wkv_b's weight, docs) -> output.
        self.latent_attend: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LatentKV | None = None,
        docs_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # One contiguous input both down-projections share: under sequence parallel the residual stream
        # is a strided view of the reduce-scatter's output, which each linear would otherwise copy.
        x_BSD = x_BSD.contiguous()
        q = self.wq(x_BSD) if self.wq is not None else self.wq_b(self.q_latent_norm(self.wq_a(x_BSD)))
        # (Under tensor + sequence parallel x holds this rank's tokens and the latents all of them.)
        B, S, _ = q.shape
        q_BHSD = q.view(B, S, -1, self.head_dim).transpose(1, 2)
        c_BSC, k_rot = self.wkv_a(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        c_BSC, k_rot_B1SR = self.kv_latent_norm(c_BSC), k_rot[:, None]
        if cache is not None:
            out_BHSD = self.cached_core(q_BHSD, c_BSC, k_rot_B1SR, cos, sin, cache)
        else:
            kv = c_BSC if self.latent_attend is not None else self.up(c_BSC)
            extra = () if docs_BS is None else (docs_BS,)  # (an argument, so that a recompute sees it)
            out_BHSD = self.core(q_BHSD, kv, k_rot_B1SR, cos, sin, *extra)
        return self.wo(out_BHSD.transpose(1, 2).reshape(B, S, -1))

    def up(self, c_BSC: torch.Tensor) -> torch.Tensor:
        """Every head's [k_nope, v] [B, H, S, N + Dv] from the latents."""
        B, S, _ = c_BSC.shape
        return self.wkv_b(c_BSC).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)

    def core(
        self,
        q_BHSD: torch.Tensor,
        kv: torch.Tensor,
        k_rot_B1SR: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary embedding, keys assembled, attention: what selective recompute reruns. `kv` is the
        up-projected [k_nope, v] [B, H, S, N + Dv], or the latents [B, S, C] under latent_attend."""
        q_nope, q_rot = q_BHSD.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin, self.interleaved)], dim=-1)
        k_rot = apply_rope(k_rot_B1SR, cos, sin, self.interleaved)
        if self.latent_attend is not None:
            return self.latent_attend(q, kv, k_rot, self.wkv_b.weight, docs_BS)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return self.attend(q, k, v, docs_BS)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs_BS: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`causal_attention` with MLA's scale; context parallel's key/value exchange replaces it."""
        return causal_attention(q, k, v, docs_BS, self.sliding_window, self.scale)

    def cached_core(
        self,
        q_BHSD: torch.Tensor,
        c_BSC: torch.Tensor,
        k_rot_B1SR: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LatentKV,
    ) -> torch.Tensor:
        """The new tokens over every cached one, in the absorbed form (the module docstring): scores
        q_nope·W_UK·cᵀ + q_rot·k_rotᵀ, output (softmax·c)·W_UVᵀ per head."""
        start = cache.length
        latents, rotary = cache.extend(c_BSC, apply_rope(k_rot_B1SR, cos, sin, self.interleaved))
        q_nope, q_rot = q_BHSD.split([self.nope, self.rope], dim=-1)
        w_HNC = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_HNC.split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("bhsn,hnc->bhsc", q_nope, w_uk)
        q = torch.cat([q_latent, apply_rope(q_rot, cos, sin, self.interleaved)], dim=-1)
        keys = torch.cat([latents[:, None], rotary], dim=-1)  # one key/value head all heads share
        out_latent = cached_attention(q, keys, latents[:, None], start, self.sliding_window, self.scale)
        return torch.einsum("bhsc,hvc->bhsv", out_latent, w_uv)
