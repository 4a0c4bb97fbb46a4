"""What the model's own code needs of its options: attention and rotary sizes (llama.py), routing (moe.py).

Torch-free, like every package's rules.py, so that a config can be checked (and `meshtron plan` can
search layouts) without importing torch; checks.py gathers the rules of every package.
"""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.layout import divisors


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


def moe_problems(cfg: ModelConfig) -> list[str]:
    """What routing needs of an MoE model's options (none for a dense model)."""
    if not cfg.is_moe:
        return []
    problems = []
    if not 1 <= cfg.top_k <= cfg.n_experts:
        problems.append(f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}")
    if cfg.moe_every < 1:
        problems.append(f"model.moe_every={cfg.moe_every} must be >= 1")
    outside = [i for i in cfg.dense_layers if not 0 <= i < cfg.n_layers]
    if outside:
        problems.append(f"model.dense_layers {outside} are outside 0..{cfg.n_layers - 1}")
    if cfg.shared_expert_gate and cfg.n_shared_experts == 0:
        problems.append("model.shared_expert_gate=true needs model.n_shared_experts >= 1")
    groups, best = cfg.n_expert_groups, cfg.topk_expert_groups
    if cfg.n_experts % groups:
        problems.append(f"model.n_experts={cfg.n_experts} is not divisible by model.n_expert_groups={groups}")
    elif best > groups or cfg.top_k > best * cfg.n_experts // groups:
        problems.append(
            f"model.topk_expert_groups={best} must be <= model.n_expert_groups={groups} and leave at "
            f"least top_k={cfg.top_k} experts to choose from ({cfg.n_experts // groups} per group)"
        )
    return problems
