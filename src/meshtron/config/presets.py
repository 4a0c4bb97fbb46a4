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
# first layer dense) on a 16B-class Llama body (GQA attention in place of multi-head latent attention, which
# meshtron does not implement).
_DEEPSEEK_ROUTING = dict(
    n_experts=64, top_k=8, moe_ffn_dim=1408, n_shared_experts=1, router="sigmoid", router_norm_topk=True,
    router_scale=2.5, n_expert_groups=8, topk_expert_groups=4, router_bias_rate=0.001, aux_loss_coef=0.0001,
    balance_loss="sequence", dense_layers=[0],
)  # fmt: skip
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
    "mixtral-8x7b":       {**_body(4096,   32,  32,  8, 14336,  32000), "rope_theta": 1e6, "n_experts": 8,
                           "top_k": 2, "router": "softmax", "router_norm_topk": True, "aux_loss_coef": 0.02},
    "deepseek-style-moe": {**_body(2048,   28,  16,  8, 10944, 102400), "rope_theta": 10000.0, **_DEEPSEEK_ROUTING},
})
# fmt: on
