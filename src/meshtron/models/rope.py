"""Rotary position embedding (Su et al. 2021) and its context extensions.

A pair of a head's dims is turned by the angle position · θ_i, with θ_i = base^(−2i/d) for the d dims the
embedding covers (a whole head, or MLA's rotary part). The frequencies may be rescaled:

  llama3  Llama 3.1's piecewise scaling: long wavelengths divided by `factor`, short ones kept, a
          smooth blend between (Dubey et al. 2024)
  yarn    YaRN (Peng et al. 2023), as DeepSeek-V2/V3 use it: per frequency a blend of the original θ_i
          (extrapolation) and θ_i / factor (interpolation), by a linear ramp between the dims that turn
          beta_fast and beta_slow times over the original context; cos and sin are multiplied by
          mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim), and MLA multiplies its
          softmax scale by mscale(factor, rope_mscale_all_dim)², with mscale(s, m) = 0.1·m·ln(s) + 1

Two layouts of the pairs: halves (dim i with dim i + d/2, Llama's) or interleaved ((x0, x1), (x2, x3),
..., DeepSeek's checkpoints); the interleaved form returns the turned pairs in the halves layout, which
is the same attention as long as queries and keys are both turned by it (transformers does the same).
"""

from __future__ import annotations

import math

import torch

from meshtron.config.schema import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `scale` (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
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


def _yarn_inv_freq(cfg: ModelConfig, dim: int) -> torch.Tensor:
    base, factor, old_len = cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_position

    def dim_of(rotations: float) -> float:  # the dim whose pair turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    original = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return original / factor * ramp + original * (1 - ramp)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [d/2] for the d = cfg.rope_size dims the embedding turns, rescaled as
    cfg.rope_scaling says."""
    dim = cfg.rope_size
    if cfg.rope_scaling == "yarn":
        return _yarn_inv_freq(cfg, dim)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return _llama3_inv_freq(cfg, inv_freq) if cfg.rope_scaling == "llama3" else inv_freq


def rope_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's temperature ratio, else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    factor = cfg.rope_scaling_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """The attention logits' scale: 1/sqrt(head size), times YaRN's mscale² under MLA (DeepSeek's rule)."""
    scale = cfg.head_size**-0.5
    if cfg.is_mla and cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape [B, S, d] for explicit positions [B, S]: a rank may hold any chunk of a sequence.
    `factor`: rope_factor's scale of both."""
    angles = positions[..., None].float() * inv_freq.float()
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(
    x_BHSDh: torch.Tensor, cos_BSDh: torch.Tensor, sin_BSDh: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x turned by its positions' angles: pairs in halves, or `interleaved` (returned in halves)."""
    if interleaved:
        half = cos_BSDh.shape[-1] // 2
        cos, sin = cos_BSDh[:, None, :, :half], sin_BSDh[:, None, :, :half]
        x1, x2 = x_BHSDh[..., 0::2], x_BHSDh[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x_BHSDh.shape[-1] // 2
    rotated = torch.cat([-x_BHSDh[..., half:], x_BHSDh[..., :half]], dim=-1)
    return x_BHSDh * cos_BSDh[:, None] + rotated * sin_BSDh[:, None]
