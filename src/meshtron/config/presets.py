"""Named model architectures (published hyper-parameters): `model.name` selects one, explicit keys
override it. Pure data, read by loading.py."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

_LLAMA3_ROPE = types.MappingProxyType(
    dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
         rope_high_freq_factor=4.0, rope_original_max_position=8192)
)  # fmt: skip


_BODY = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def _body(*sizes: int) -> dict[str, int]:
    """A Llama body's sizes, in the order of _BODY (the table's columns below)."""
    return dict(zip(_BODY, sizes, strict=True))


_TINY = types.MappingProxyType(_body(64, 2, 4, 2, 176, 512))
# DeepSeek-V3's routing (256 -> here 64 fine-grained experts, top-8 among the best 4 of 8 groups, one shared
# expert, sigmoid scores scaled by 2.5, auxiliary-loss-free bias plus a tiny sequence-wise balance loss, the
# first layer dense) on a 16B-class Llama body (grouped-query attention; deepseek-v3 has latent attention).
_DEEPSEEK_ROUTING = dict(
    n_experts=64, top_k=8, moe_ffn_dim=1408, n_shared_experts=1, router="sigmoid", router_norm_topk=True,
    router_scale=2.5, n_expert_groups=8, topk_expert_groups=4, router_bias_rate=0.001, aux_loss_coef=0.0001,
    balance_loss="sequence", dense_layers=[0],
)  # fmt: skip
# DeepSeek-V3 (DeepSeek-AI 2024, its config.json): multi-head latent attention (latents of 512 for keys
# and values, 1,536 for queries, a 64-dim rotary key, 128 + 64 query/key and 128 value dims per head),
# YaRN to 160K positions, 256 routed experts of 2,048 in 8 groups (top-8 from the best 4), the first 3
# layers dense, one multi-token prediction module.
_DEEPSEEK_V3 = dict(
    _DEEPSEEK_ROUTING, n_experts=256, moe_ffn_dim=2048, dense_layers=[0, 1, 2], router_bias=True,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_interleave=True, rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_position=4096,
    rope_mscale=1.0, rope_mscale_all_dim=1.0, norm_eps=1e-6, mtp_depth=1,
)  # fmt: skip
# Its shape in miniature for tests: latent attention, 8 experts in 4 groups (top-4 from the best 2), one
# shared expert, the first layer dense, YaRN and interleaved rotary pairs.
_TINY_DEEPSEEK = dict(
    _DEEPSEEK_V3, n_experts=8, top_k=4, moe_ffn_dim=32, n_expert_groups=4, topk_expert_groups=2,
    dense_layers=[0], kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    rope_scaling_factor=4.0, rope_original_max_position=16, mtp_depth=0, aux_loss_coef=0.001,
    router_bias_rate=0.01,
)  # fmt: skip
# Qwen3's MoE models (Qwen team 2025, their config.json): grouped-query attention with RMSNorm on each
# head's queries and keys, 128 experts, top-8 with the chosen gates renormalised, no shared expert.
_QWEN3_MOE = dict(
    head_dim=128, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, n_experts=128, top_k=8, router="softmax",
    router_norm_topk=True, aux_loss_coef=0.001,
)  # fmt: skip
_MIXTRAL = dict(rope_theta=1e6, n_experts=8, top_k=2, router="softmax", router_norm_topk=True)
# Architectures of named models (published hyper-parameters); explicit keys override them.
# fmt: off
PRESETS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
    #                          dim    layers heads kv  ffn    vocab
    "tiny":               _TINY,
    "tiny-moe":           {**_TINY, "n_experts": 4, "top_k": 2, "moe_ffn_dim": 96, "n_shared_experts": 1},
    "llama3-1b":          {**_body(2048,   16,  32,  8,  8192, 128256), "tie_embeddings": True, **_LLAMA3_ROPE},
    "llama3-8b":          {**_body(4096,   32,  32,  8, 14336, 128256), **_LLAMA3_ROPE},
    "llama3-70b":         {**_body(8192,   80,  64,  8, 28672, 128256), **_LLAMA3_ROPE},
    "llama3-405b":        {**_body(16384, 126, 128,  8, 53248, 128256), **_LLAMA3_ROPE},
    "mixtral-8x7b":       {**_body(4096,   32,  32,  8, 14336,  32000), **_MIXTRAL, "aux_loss_coef": 0.02},
    "mixtral-8x22b":      {**_body(6144,   56,  48,  8, 16384,  32000), **_MIXTRAL, "aux_loss_coef": 0.001},
    "qwen3-30b-a3b":      {**_body(2048,   48,  32,  4,  6144, 151936), **_QWEN3_MOE, "moe_ffn_dim": 768},
    "qwen3-235b-a22b":    {**_body(4096,   94,  64,  4, 12288, 151936), **_QWEN3_MOE, "moe_ffn_dim": 1536},
    "deepseek-style-moe": {**_body(2048,   28,  16,  8, 10944, 102400), "rope_theta": 10000.0, **_DEEPSEEK_ROUTING},
    "deepseek-v3":        {**_body(7168,   61, 128, 128, 18432, 129280), **_DEEPSEEK_V3},
    "tiny-deepseek":      {**_body(64,      3,   4,  4,   176,    512), **_TINY_DEEPSEEK},
})
# fmt: on
