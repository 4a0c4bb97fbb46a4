"""Named model architectures (published hyper-parameters): `model.name` selects one, explicit keys
override it. Pure data, read by config.py."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

_LLAMA3_ROPE = types.MappingProxyType(
    dict(
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
    )
)
_TINY = types.MappingProxyType(dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=512))
# Architectures of named models (published hyper-parameters); explicit keys override them.
PRESETS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
    {
        "tiny": _TINY,
        "tiny-moe": {**_TINY, "n_experts": 4, "top_k": 2, "moe_ffn_dim": 96, "n_shared_experts": 1},
        "llama3-1b": dict(
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            vocab_size=128256,
            tie_embeddings=True,
            **_LLAMA3_ROPE,
        ),
        "llama3-8b": dict(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, **_LLAMA3_ROPE
        ),
        "llama3-70b": dict(
            dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, **_LLAMA3_ROPE
        ),
        "llama3-405b": dict(
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            ffn_dim=53248,
            vocab_size=128256,
            **_LLAMA3_ROPE,
        ),
        "mixtral-8x7b": dict(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            vocab_size=32000,
            rope_theta=1e6,
            n_experts=8,
            top_k=2,
            router="softmax",
            router_norm_topk=True,
            aux_loss_coef=0.02,
        ),
        # DeepSeek-V3's routing (256 -> here 64 fine-grained experts, top-8 among the best 4 of 8 groups,
        # one shared expert, sigmoid scores scaled by 2.5, auxiliary-loss-free bias plus a tiny
        # sequence-wise balance loss, the first layer dense) on a 16B-class Llama body (GQA attention in
        # place of multi-head latent attention, which meshtron does not implement).
        "deepseek-style-moe": dict(
            dim=2048,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            ffn_dim=10944,
            vocab_size=102400,
            rope_theta=10000.0,
            n_experts=64,
            top_k=8,
            moe_ffn_dim=1408,
            n_shared_experts=1,
            router="sigmoid",
            router_norm_topk=True,
            router_scale=2.5,
            n_expert_groups=8,
            topk_expert_groups=4,
            router_bias_rate=0.001,
            aux_loss_coef=0.0001,
            balance_loss="sequence",
            dense_layers=[0],
        ),
    }
)
