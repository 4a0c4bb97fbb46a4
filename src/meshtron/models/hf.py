"""Hugging Face checkpoints <-> meshtron models: config mapping, weight renaming, strict loading.

`load` reads a directory as `transformers` writes it (config.json + model.safetensors, or shards with
model.safetensors.index.json) for llama, mistral, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe;
`save` writes one that `transformers.AutoModelForCausalLM.from_pretrained` loads with no missing or
unexpected keys. The mapping follows what transformers 5 computes, not only what its configs name:
e.g. Qwen2 always has q/k/v biases, Qwen3 defaults head_dim to 128, Mixtral always renormalises its
top-k routing weights.

Weight names (per layer i, HF side under `model.layers.{i}.`):
    tok_embeddings / norm / output          model.embed_tokens / model.norm / lm_head
    attention_norm / ffn_norm               input_layernorm / post_attention_layernorm
    attention.{wq,wk,wv,wo}                 self_attn.{q,k,v,o}_proj   (+ bias on q/k/v)
    attention.{q_norm,k_norm}               self_attn.{q_norm,k_norm}
    feed_forward.{w1,w3,w2}                 mlp.{gate,up,down}_proj
    moe.router                              mlp.gate  (Mixtral: block_sparse_moe.gate)
    moe.experts.{w1,w3,w2} [E, ...]         mlp.experts.{j}.{gate,up,down}_proj  (Mixtral:
                                            block_sparse_moe.experts.{j}.{w1,w3,w2}); fused
                                            experts.gate_up_proj [E, 2F, D] / experts.down_proj
                                            [E, D, F] is accepted on load
    moe.shared_experts.{w1,w3,w2}           mlp.shared_expert.{gate,up,down}_proj
    moe.shared_gate                         mlp.shared_expert_gate

What `save` refuses (no supported HF architecture computes it): a sigmoid router, shared experts
without a sigmoid gate, q/k norms together with q/k/v biases (Qwen3's `attention_bias` also biases
o_proj), shared experts with q/k norms, and a Mixtral-shaped MoE (no shared experts, no q/k norms)
that does not renormalise its top-k weights, has dense layers, or has q/k/v biases. What it writes
without a trace, because it changes training but not the function the weights compute:
`capacity_factor` (HF inference is dropless, which equals meshtron's capacity_factor=0) and
`z_loss_coef`; `aux_loss_coef` becomes `router_aux_loss_coef`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshtron.config import ModelConfig
from meshtron.models.llama import Transformer, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

ARCHITECTURES = (
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("mixtral", "MixtralForCausalLM"),
    ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"),
)

# meshtron has no maximum length (RoPE is computed per position), but HF configs carry one.
DEFAULT_MAX_POSITIONS = 8192

# meshtron key suffix inside a layer -> HF key suffix inside `model.layers.{i}.`; `{moe}` is the
# MoE block's module name.
LAYER_RENAMES = (
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("attention.wq.bias", "self_attn.q_proj.bias"),
    ("attention.wk.bias", "self_attn.k_proj.bias"),
    ("attention.wv.bias", "self_attn.v_proj.bias"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("moe.router.weight", "{moe}.gate.weight"),
    ("moe.shared_experts.w1.weight", "{moe}.shared_expert.gate_proj.weight"),
    ("moe.shared_experts.w3.weight", "{moe}.shared_expert.up_proj.weight"),
    ("moe.shared_experts.w2.weight", "{moe}.shared_expert.down_proj.weight"),
    ("moe.shared_gate.weight", "{moe}.shared_expert_gate.weight"),
)
GLOBAL_RENAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
# Per-expert projection names for our (w1 gate, w3 up, w2 down), in the two HF spellings.
QWEN_EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
MIXTRAL_EXPERT_NAMES = (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))
# Buffers older transformers wrote into checkpoints; they are recomputed, never loaded.
IGNORED_KEY_PATTERN = re.compile(r"\.rotary_emb\.inv_freq$")


def _defaults(model_type: str) -> dict[str, Any]:
    """The transformers 5 config defaults that matter when a config.json omits a key."""
    defaults: dict[str, Any] = dict(
        num_key_value_heads=None,
        head_dim=None,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        sliding_window=None,
        use_sliding_window=False,
        max_window_layers=28,
    )
    per_type: dict[str, dict[str, Any]] = {
        "llama": {},
        "mistral": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=4096 * 32),
        "qwen2": dict(num_key_value_heads=32, sliding_window=4096, max_position_embeddings=32768),
        "qwen3": dict(
            num_key_value_heads=32, head_dim=128, sliding_window=4096, max_position_embeddings=32768
        ),
        "mixtral": dict(
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            max_position_embeddings=4096 * 32,
            num_experts_per_tok=2,
            num_local_experts=8,
            router_aux_loss_coef=0.001,
        ),
        "qwen2_moe": dict(
            num_key_value_heads=16,
            sliding_window=4096,
            max_position_embeddings=32768,
            decoder_sparse_step=1,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts_per_tok=4,
            num_experts=60,
            norm_topk_prob=False,
            router_aux_loss_coef=0.001,
            mlp_only_layers=None,
            qkv_bias=True,
        ),
        "qwen3_moe": dict(
            num_key_value_heads=4,
            sliding_window=4096,
            max_position_embeddings=32768,
            decoder_sparse_step=1,
            moe_intermediate_size=768,
            num_experts_per_tok=8,
            num_experts=128,
            norm_topk_prob=False,
            router_aux_loss_coef=0.001,
            mlp_only_layers=None,
        ),
    }
    return {**defaults, **per_type[model_type]}


def _rope_from_hf(hf: Mapping[str, Any], get: Callable[[str], Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig rope fields from old-style rope_theta/rope_scaling or transformers-5 rope_parameters.

    transformers 5 lets a non-null `rope_scaling` override `rope_parameters`, and takes the theta
    from inside the dict before the top-level `rope_theta`; we resolve them in the same order.
    """
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        problems.append(f"rope parameters must be a JSON object, got {params!r}")
        return {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        problems.append(
            f"per-layer-type rope parameters ({', '.join(params)}) are not supported; "
            "meshtron uses one RoPE for every layer"
        )
        return {}
    theta = params.get("rope_theta") or get("rope_theta")
    out: dict[str, Any] = dict(rope_theta=float(theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(
            f"rope type {rope_type!r} is not supported; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
        return out
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} is not supported (only full-width RoPE)")
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            problems.append(f"llama3 rope scaling is missing {', '.join(missing)}")
            return out
        out.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings, as we do.
            rope_original_max_position=int(
                params.get("original_max_position_embeddings") or get("max_position_embeddings")
            ),
        )
    return out


def _sliding_window_from_hf(
    model_type: str, get: Callable[[str], Any], n_layers: int, problems: list[str]
) -> int:
    """The one window meshtron applies to every layer, or 0; mixed per-layer windows are refused."""
    if model_type in ("mistral", "mixtral"):
        return int(get("sliding_window") or 0)
    if model_type == "llama":
        return 0
    window = int(get("sliding_window") or 0) if get("use_sliding_window") else 0
    if model_type == "qwen3_moe":
        return window  # Qwen3-MoE applies its window to every layer
    layer_types = get("layer_types")
    if layer_types is None:
        # How transformers derives the layer pattern when config.json does not spell it out.
        max_window = get("max_window_layers")
        if model_type == "qwen2_moe":
            sliding = [bool((i + 1) % 2) and i < max_window and window > 0 for i in range(n_layers)]
        else:
            sliding = [window > 0 and i >= max_window for i in range(n_layers)]
    else:
        sliding = [t == "sliding_attention" for t in layer_types]
    windows = {window if s else 0 for s in sliding}
    if len(windows) > 1:
        problems.append(
            f"sliding window {window} on only some layers ({[i for i, s in enumerate(sliding) if s]}) is "
            "not supported; meshtron applies one window to every layer"
        )
        return 0
    return windows.pop() if windows else 0


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig equivalent to a transformers config.json dict; ValueError lists what cannot map."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    defaults = _defaults(model_type)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ValueError(f"{model_type} config is missing {', '.join(missing)}")

    def get(key: str) -> Any:
        return hf[key] if key in hf else defaults.get(key)

    problems: list[str] = []
    n_layers = int(hf["num_hidden_layers"])
    kwargs: dict[str, Any] = dict(
        dim=int(hf["hidden_size"]),
        n_layers=n_layers,
        n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=int(get("head_dim") or 0),
        ffn_dim=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=_sliding_window_from_hf(model_type, get, n_layers, problems),
        **_rope_from_hf(hf, get, problems),
    )
    if get("hidden_act") not in ("silu", "swish"):
        problems.append(f"hidden_act={get('hidden_act')!r} is not supported (only silu/SwiGLU)")
    if model_type == "llama" and get("mlp_bias"):
        problems.append("mlp_bias=true is not supported (meshtron's feed-forward has no biases)")
    if model_type in ("llama", "qwen3", "qwen3_moe") and get("attention_bias"):
        problems.append(
            f"attention_bias=true is not supported for {model_type}: it biases o_proj too, "
            "and meshtron's output projection has no bias"
        )
    if model_type == "qwen2":
        kwargs["qkv_bias"] = True  # Qwen2 attention always has q/k/v biases, whatever the config says
    elif model_type == "qwen2_moe":
        kwargs["qkv_bias"] = bool(get("qkv_bias"))

    if model_type == "mixtral":
        kwargs.update(
            n_experts=int(get("num_local_experts")),
            top_k=int(get("num_experts_per_tok")),
            moe_ffn_dim=int(hf["intermediate_size"]),
            router="softmax",
            router_norm_topk=True,
            aux_loss_coef=float(get("router_aux_loss_coef")),
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # Qwen3-MoE's config aliases num_experts to num_local_experts and saves the latter.
        n_experts = hf.get("num_experts", hf.get("num_local_experts", get("num_experts")))
        sparse_step = int(get("decoder_sparse_step"))
        if sparse_step < 1:
            problems.append(f"decoder_sparse_step={sparse_step} must be >= 1")
        kwargs.update(
            n_experts=int(n_experts),
            top_k=int(get("num_experts_per_tok")),
            moe_ffn_dim=int(get("moe_intermediate_size")),
            router="softmax",
            router_norm_topk=bool(get("norm_topk_prob")),
            aux_loss_coef=float(get("router_aux_loss_coef")),
            moe_every=max(sparse_step, 1),
            dense_layers=[int(i) for i in (get("mlp_only_layers") or [])],
        )
        if model_type == "qwen2_moe" and n_experts:
            shared = int(get("shared_expert_intermediate_size"))
            if shared <= 0:
                problems.append(f"shared_expert_intermediate_size={shared} must be positive")
            kwargs.update(n_shared_experts=1, shared_ffn_dim=shared, shared_expert_gate=True)
    if problems:
        raise ValueError(f"cannot convert this {model_type} config: " + "; ".join(problems))
    return ModelConfig(**kwargs)


def _hf_model_type(cfg: ModelConfig) -> str:
    """The HF architecture that computes exactly what `cfg` does; ValueError when none does."""
    problems: list[str] = []
    if cfg.is_moe:
        if cfg.router != "softmax":
            problems.append(f"router={cfg.router!r}: the supported HF MoE architectures use a softmax router")
        if cfg.n_shared_experts and not cfg.shared_expert_gate:
            problems.append(
                "shared experts without shared_expert_gate (Qwen2-MoE's shared experts are gated)"
            )
        if cfg.shared_expert_gate and not cfg.n_shared_experts:
            problems.append("shared_expert_gate=true needs n_shared_experts >= 1")
        if cfg.n_shared_experts:
            model_type = "qwen2_moe"
            if cfg.qk_norm:
                problems.append("shared experts with qk_norm (Qwen2-MoE has no q/k norms)")
        elif cfg.qk_norm:
            model_type = "qwen3_moe"
            if cfg.qkv_bias:
                problems.append("qk_norm with qkv_bias (Qwen3-MoE's attention_bias also biases o_proj)")
        else:
            model_type = "mixtral"
            if not cfg.router_norm_topk:
                problems.append(
                    "router_norm_topk=false without shared experts or qk_norm (Mixtral always renormalises)"
                )
            if cfg.moe_every != 1 or cfg.dense_layers:
                problems.append("dense layers without shared experts or qk_norm (every Mixtral layer is MoE)")
            if cfg.qkv_bias:
                problems.append("qkv_bias without shared experts or qk_norm (Mixtral has no q/k/v biases)")
    elif cfg.qk_norm:
        model_type = "qwen3"
        if cfg.qkv_bias:
            problems.append("qk_norm with qkv_bias (Qwen3's attention_bias also biases o_proj)")
    elif cfg.qkv_bias:
        model_type = "qwen2"
    elif cfg.sliding_window:
        model_type = "mistral"
    else:
        model_type = "llama"
    if cfg.rope_scaling not in ("none", "llama3"):
        problems.append(f"rope_scaling={cfg.rope_scaling!r} (supported: none, llama3)")
    if problems:
        raise ValueError("no Hugging Face architecture can express this ModelConfig: " + "; ".join(problems))
    return model_type


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A transformers config.json dict for `cfg` (model_type picked by what the config uses)."""
    model_type = _hf_model_type(cfg)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling: dict[str, Any] | None = None
    max_positions = DEFAULT_MAX_POSITIONS
    if cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
        }
        rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_theta}
        max_positions = int(cfg.rope_original_max_position * cfg.rope_scaling_factor)
    out: dict[str, Any] = {
        "architectures": [dict(ARCHITECTURES)[model_type]],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max_positions,
        "attention_dropout": 0.0,
        "use_cache": True,
        # transformers < 5 reads rope_theta/rope_scaling, transformers 5 rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "dtype": _dtype_name(dtype),
        "torch_dtype": _dtype_name(dtype),
    }
    window = cfg.sliding_window or None
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if model_type == "llama":
        out["mlp_bias"] = False
    if model_type in ("mistral", "mixtral"):
        out["sliding_window"] = window
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        out.update(use_sliding_window=bool(window), sliding_window=window, max_window_layers=0)
        if model_type != "qwen3_moe":
            kind = "sliding_attention" if window else "full_attention"
            out["layer_types"] = [kind] * cfg.n_layers
    if model_type == "mixtral":
        out.update(
            intermediate_size=cfg.expert_ffn_dim,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=cfg.aux_loss_coef,
            router_jitter_noise=0.0,
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.expert_ffn_dim,
            norm_topk_prob=cfg.router_norm_topk,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=sorted(cfg.dense_layers),
            router_aux_loss_coef=cfg.aux_loss_coef,
        )
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_ffn_dim, qkv_bias=cfg.qkv_bias)
    return out


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded safetensors checkpoint, by name."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(absent)}")
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if key in tensors:
                    raise ValueError(f"tensor {key!r} appears in more than one shard (again in {file.name})")
                tensors[key] = f.get_tensor(key)
    return tensors


def _names(keys: Iterable[str], limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


class _Source:
    """Hands out checkpoint tensors by HF name, remembering which were used and what was missing."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.bad_shapes: list[str] = []

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if key not in self.tensors:
            self.missing.append(key)
            return None
        self.used.add(key)
        tensor = self.tensors[key]
        if tuple(tensor.shape) != tuple(shape):
            self.bad_shapes.append(f"{key}: checkpoint {list(tensor.shape)}, expected {list(shape)}")
            return None
        return tensor


def _load_experts(
    src: _Source, layer: str, cfg: ModelConfig, model_type: str
) -> dict[str, torch.Tensor | None]:
    """Our stacked experts.{w1,w3,w2} from per-expert 2-D tensors or the fused 3-D layout."""
    E, D, F = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
    # transformers 5 names Mixtral's block `mlp` internally; checkpoints use `block_sparse_moe`.
    blocks = ("block_sparse_moe", "mlp") if model_type == "mixtral" else ("mlp",)
    styles = [(block, names) for block in blocks for names in (MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES)]
    for block in blocks:
        fused = f"{layer}{block}.experts.gate_up_proj"
        if src.has(fused):
            gate_up = src.take(fused, (E, 2 * F, D))
            down = src.take(f"{layer}{block}.experts.down_proj", (E, D, F))
            return {
                "w1": None if gate_up is None else gate_up[:, :F],
                "w3": None if gate_up is None else gate_up[:, F:],
                "w2": down,
            }
    default = (blocks[0], MIXTRAL_EXPERT_NAMES if model_type == "mixtral" else QWEN_EXPERT_NAMES)
    block, names = next(
        ((b, n) for b, n in styles if src.has(f"{layer}{b}.experts.0.{n[0][1]}.weight")), default
    )
    out: dict[str, torch.Tensor | None] = {}
    for ours, theirs in names:
        shape = (D, F) if ours == "w2" else (F, D)
        parts = [src.take(f"{layer}{block}.experts.{j}.{theirs}.weight", shape) for j in range(E)]
        out[ours] = None if any(p is None for p in parts) else torch.stack(parts)  # type: ignore[arg-type]
    return out


def _moe_block_name(src: _Source, layer: str, model_type: str) -> str:
    if model_type == "mixtral" and not src.has(f"{layer}mlp.gate.weight"):
        return "block_sparse_moe"
    return "mlp"


def load(path: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """A meshtron Transformer from a transformers checkpoint directory; strict about every tensor."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist; expected a transformers checkpoint directory")
    hf_config = json.loads(config_file.read_text())
    cfg = config_from_hf(hf_config)
    model_type = hf_config["model_type"]
    tensors = _read_checkpoint(path)
    src = _Source(tensors)

    # A checkpoint without lm_head ties it to the embedding, as transformers does.
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    elif cfg.tie_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")
        if embed is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
            raise ValueError(
                "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                "set tie_word_embeddings=false in config.json to load a separate output head"
            )
        src.used.add("lm_head.weight")

    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    global_names = dict(GLOBAL_RENAMES)
    state: dict[str, torch.Tensor | None] = {}
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}."
        block = _moe_block_name(src, layer, model_type)
        renames = {ours: theirs.format(moe=block) for ours, theirs in LAYER_RENAMES}
        prefix = f"layers.{i}."
        for name in (n for n in expected if n.startswith(prefix)):
            suffix = name[len(prefix) :]
            if suffix.startswith("moe.experts."):
                continue
            state[name] = src.take(layer + renames[suffix], expected[name])
        if cfg.is_moe_layer(i):
            experts = _load_experts(src, layer, cfg, model_type)
            for w, tensor in experts.items():
                state[f"{prefix}moe.experts.{w}"] = tensor
    for name in (n for n in expected if not n.startswith("layers.")):
        state[name] = src.take(global_names[name], expected[name])

    unexpected = [k for k in tensors if k not in src.used and not IGNORED_KEY_PATTERN.search(k)]
    problems = []
    if src.missing:
        problems.append(f"missing tensors: {_names(src.missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if src.bad_shapes:
        problems.append(f"shape mismatches: {'; '.join(src.bad_shapes)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not fit a {model_type} model: " + " | ".join(problems))

    model.load_state_dict(
        {name: t.to(dtype).contiguous() for name, t in state.items() if t is not None},
        strict=True,
        assign=True,
    )
    model.rope_inv_freq = rope_inv_freq(cfg)  # the meta-device buffer holds no values
    return model.eval()


def save(model: Transformer, path: str | Path) -> None:
    """Write config.json and model.safetensors in the classic HF naming (per-expert tensors).

    Expects a plain single-device model; gather a sharded one into a full state first.
    """
    path = Path(path)
    cfg = model.cfg
    hf_config = config_to_hf(cfg, next(model.parameters()).dtype)
    model_type = hf_config["model_type"]
    if (path / "model.safetensors.index.json").exists():
        raise FileExistsError(
            f"{path} holds a sharded checkpoint whose index would shadow the new weights; save elsewhere"
        )
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    expert_names = dict(MIXTRAL_EXPERT_NAMES if model_type == "mixtral" else QWEN_EXPERT_NAMES)
    renames = {ours: theirs.format(moe=block) for ours, theirs in LAYER_RENAMES}
    global_names = dict(GLOBAL_RENAMES)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        # Clones: safetensors refuses tensors that share storage (tied weights, per-expert views).
        tensor = tensor.detach().to("cpu")
        if not name.startswith("layers."):
            tensors[global_names[name]] = tensor.clone()
            continue
        _, i, suffix = name.split(".", 2)
        layer = f"model.layers.{i}."
        if suffix.startswith("moe.experts."):
            w = suffix.rsplit(".", 1)[1]
            for j in range(tensor.shape[0]):
                tensors[f"{layer}{block}.experts.{j}.{expert_names[w]}.weight"] = tensor[j].clone()
        else:
            tensors[layer + renames[suffix]] = tensor.clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
