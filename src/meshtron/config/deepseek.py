"""DeepSeek-V3's config.json (transformers' `deepseek_v3`) <-> ModelConfig.

What DeepseekV3ForCausalLM computes, in meshtron's keys: multi-head latent attention (kv_lora_rank,
q_lora_rank, the head dims, interleaved rotary pairs, YaRN), the first `first_k_dense_replace` layers
dense and the rest MoE with sigmoid scores, a correction bias for the choice, group-limited top-k
(n_group, topk_group), renormalised and scaled gates (routed_scaling_factor) and ungated shared experts of
n_shared_experts · moe_intermediate_size. The checkpoint's multi-token prediction layers (stored past
num_hidden_layers) are the run's choice (`model.mtp_depth`), not the architecture's: transformers'
model ignores them, and so does a config read here. The training options DeepSeek-V3's report gives
are the defaults (the sequence-wise balance loss with α = 1e-4, the bias moving 1e-3 per step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshtron.config.schema import ModelConfig

# transformers 5's DeepseekV3Config defaults for keys a config.json may omit.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
    rope_theta=10000.0,
)  # fmt: skip
# DeepSeek-V3's report (sec. 2.1.2, 4.2): the sequence-wise loss's α and the bias speed γ.
TRAINING = dict(balance_loss="sequence", aux_loss_coef=1e-4, router_bias_rate=1e-3)


def _yarn(params: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or get("max_position_embeddings"))
    if factor is None:  # transformers' rule: the stretch of max_position_embeddings over the original
        factor = get("max_position_embeddings") / original
    return dict(
        rope_scaling="yarn",
        rope_scaling_factor=float(factor),
        rope_original_max_position=original,
        rope_beta_fast=float(params.get("beta_fast") or 32),
        rope_beta_slow=float(params.get("beta_slow") or 1),
        rope_mscale=float(params.get("mscale") or 0.0),
        rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def deepseek_from_hf(hf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a deepseek_v3 config.json; what cannot map goes to `problems`."""

    def get(key: str) -> Any:
        return hf[key] if key in hf else DEFAULTS.get(key)

    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope: dict[str, Any] = dict(rope_theta=float(params.get("rope_theta") or get("rope_theta")))
    if rope_type == "yarn":
        rope.update(_yarn(params, get))
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} is not supported for deepseek_v3 (default or yarn)")
    if get("hidden_act") not in ("silu", "swish"):
        problems.append(f"hidden_act={get('hidden_act')!r} is not supported (only silu/SwiGLU)")
    if get("attention_bias"):
        problems.append("attention_bias=true is not supported (meshtron's MLA projections have no biases)")
    n_layers, dense = int(get("num_hidden_layers")), int(get("first_k_dense_replace") or 0)
    n_experts = int(hf.get("n_routed_experts", hf.get("num_local_experts", DEFAULTS["n_routed_experts"])))
    return dict(
        dim=int(get("hidden_size")),
        n_layers=n_layers,
        n_heads=int(get("num_attention_heads")),
        ffn_dim=int(get("intermediate_size")),
        vocab_size=int(get("vocab_size")),
        norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")),
        kv_lora_rank=int(get("kv_lora_rank")),
        q_lora_rank=int(get("q_lora_rank") or 0),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        rope_interleave=bool(get("rope_interleave")),
        n_experts=n_experts if dense < n_layers else 0,
        top_k=int(get("num_experts_per_tok")),
        moe_ffn_dim=int(get("moe_intermediate_size")),
        n_shared_experts=int(get("n_shared_experts") or 0),
        router="sigmoid",
        router_bias=True,
        router_norm_topk=bool(get("norm_topk_prob")),
        router_scale=float(get("routed_scaling_factor")),
        n_expert_groups=int(get("n_group") or 1),
        topk_expert_groups=int(get("topk_group") or 1),
        dense_layers=list(range(min(dense, n_layers))),
        **TRAINING,
        **rope,
    )


def deepseek_problems(cfg: ModelConfig) -> list[str]:
    """What an MLA config must also be for DeepseekV3ForCausalLM to compute it."""
    problems = []
    if cfg.qk_norm or cfg.qkv_bias or cfg.sliding_window:
        problems.append("qk_norm, qkv_bias or a sliding window (DeepSeek-V3's attention has none)")
    if cfg.rope_scaling == "llama3":
        problems.append("llama3 rope scaling (DeepSeek-V3 stretches its context with YaRN)")
    if cfg.is_moe:
        if cfg.router != "sigmoid":
            problems.append(f"router={cfg.router!r} (DeepSeek-V3's router is sigmoid)")
        if cfg.moe_every != 1 or sorted(cfg.dense_layers) != list(range(len(cfg.dense_layers))):
            problems.append("dense layers other than the first ones (first_k_dense_replace)")
        if cfg.shared_expert_gate or cfg.shared_expert_ffn_dim != cfg.n_shared_experts * cfg.expert_ffn_dim:
            problems.append("gated shared experts, or of another width than n_shared_experts * moe_ffn_dim")
    return problems


def deepseek_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The deepseek_v3 keys of `cfg`'s config.json (the caller adds what every architecture has)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=cfg.rope_scaling_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            mscale=cfg.rope_mscale,
            mscale_all_dim=cfg.rope_mscale_all_dim,
        )
    moe = cfg.is_moe
    stretched = {}
    if cfg.rope_scaling == "yarn":
        stretched = {"max_position_embeddings": int(cfg.rope_original_max_position * cfg.rope_scaling_factor)}
    return dict(
        **stretched,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.qk_rope_head_dim,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave,
        attention_bias=False,
        n_routed_experts=cfg.n_experts if moe else 1,
        num_experts_per_tok=cfg.top_k if moe else 1,
        moe_intermediate_size=cfg.expert_ffn_dim if moe else cfg.ffn_dim,
        n_shared_experts=cfg.n_shared_experts if moe else 0,
        routed_scaling_factor=cfg.router_scale,
        n_group=cfg.n_expert_groups if moe else 1,
        topk_group=cfg.topk_expert_groups if moe else 1,
        norm_topk_prob=cfg.router_norm_topk,
        first_k_dense_replace=len(cfg.dense_layers) if moe else cfg.n_layers,
        rope_parameters=rope,
        rope_scaling=rope if cfg.rope_scaling == "yarn" else None,
        num_nextn_predict_layers=cfg.mtp_depth,
    )
