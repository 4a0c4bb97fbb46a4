"""Hugging Face config.json <-> meshtron ModelConfig, for the architectures meshtron computes exactly.

The mapping follows what transformers 5 computes, not only what its configs name: e.g. Qwen2 always has
q/k/v biases, Qwen3 defaults head_dim to 128, Mixtral always renormalises its top-k routing weights.
`config_to_hf` picks the one architecture that computes what a ModelConfig does, and refuses one that no
supported architecture expresses (see hf/weights.py's docstring for the list).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from meshtron.config.deepseek import deepseek_from_hf, deepseek_problems, deepseek_to_hf
from meshtron.config.schema import ModelConfig

HEAD = "lm_head.weight"  # the output head's tensor; a checkpoint without one ties it to the embedding

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3")

ARCHITECTURES = (
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("mixtral", "MixtralForCausalLM"),
    ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"),
)

# meshtron has no maximum length (RoPE is computed per position), but HF configs carry one.
DEFAULT_MAX_POSITIONS = 8192


# transformers 5's config defaults that matter when a config.json omits a key: for every model type, then
# per type (keys shared by the MoE types in _MOE).
_DEFAULTS = dict(
    num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02, attention_bias=False,
    mlp_bias=False, sliding_window=None, use_sliding_window=False, max_window_layers=28,
)  # fmt: skip
_MOE = dict(router_aux_loss_coef=0.001, decoder_sparse_step=1, norm_topk_prob=False, mlp_only_layers=None)
_QWEN = dict(sliding_window=4096, max_position_embeddings=32768)
# fmt: off
_DEFAULTS_BY_TYPE: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=4096 * 32),
    "qwen2": dict(num_key_value_heads=32, **_QWEN),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, **_QWEN),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32,
                    num_experts_per_tok=2, num_local_experts=8, router_aux_loss_coef=0.001),
    "qwen2_moe": dict(num_key_value_heads=16, **_QWEN, **_MOE, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60, qkv_bias=True),
    "qwen3_moe": dict(num_key_value_heads=4, **_QWEN, **_MOE, moe_intermediate_size=768, num_experts_per_tok=8,
                      num_experts=128),
}
# fmt: on


def _defaults(model_type: str) -> dict[str, Any]:
    """The transformers 5 config defaults that matter when a config.json omits a key."""
    return {**_DEFAULTS, **_DEFAULTS_BY_TYPE[model_type]}


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


def _moe_from_hf(
    model_type: str, hf: Mapping[str, Any], get: Callable[[str], Any], problems: list[str]
) -> dict[str, Any]:
    """The MoE keys of Mixtral's and Qwen-MoE's configs (none for the dense types)."""
    out: dict[str, Any] = {}
    if model_type == "mixtral":
        out.update(
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
        out.update(
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
            out.update(n_shared_experts=1, shared_ffn_dim=shared, shared_expert_gate=True)
    return out


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig equivalent to a transformers config.json dict; ValueError lists what cannot map."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "deepseek_v3":
        problems: list[str] = []
        deepseek = deepseek_from_hf(hf, problems)
        if problems:
            raise ValueError(f"cannot convert this {model_type} config: " + "; ".join(problems))
        return ModelConfig(**deepseek)
    defaults = _defaults(model_type)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ValueError(f"{model_type} config is missing {', '.join(missing)}")

    def get(key: str) -> Any:
        return hf[key] if key in hf else defaults.get(key)

    problems = []
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

    kwargs.update(_moe_from_hf(model_type, hf, get, problems))
    if problems:
        raise ValueError(f"cannot convert this {model_type} config: " + "; ".join(problems))
    return ModelConfig(**kwargs)


def _hf_model_type(cfg: ModelConfig) -> str:
    """The HF architecture that computes exactly what `cfg` does; ValueError when none does."""
    problems: list[str] = []
    if cfg.is_mla:
        model_type, problems = "deepseek_v3", deepseek_problems(cfg)
    elif cfg.is_moe:
        if cfg.router != "softmax":
            problems.append(f"router={cfg.router!r}: the supported HF MoE architectures use a softmax router")
        if cfg.router_scale != 1 or cfg.n_expert_groups > 1 or cfg.router_bias_rate > 0:
            problems.append(
                "router_scale, group-limited routing (n_expert_groups) or a balancing bias (router_bias_rate): "
                "DeepSeek-V3's routing, which no supported HF architecture computes"
            )
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
    if cfg.rope_scaling == "yarn" and not cfg.is_mla:
        problems.append("rope_scaling='yarn' outside multi-head latent attention (DeepSeek-V3's)")
    if cfg.mtp_depth > 1:
        problems.append(f"mtp_depth={cfg.mtp_depth} (DeepSeek-V3's checkpoints ship one MTP module)")
    if problems:
        raise ValueError("no Hugging Face architecture can express this ModelConfig: " + "; ".join(problems))
    return model_type


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
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
        "dtype": dtype,
        "torch_dtype": dtype,
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
    if model_type == "deepseek_v3":
        out.update(deepseek_to_hf(cfg))
    return out


# Weight files that are Python pickles (and the index of sharded ones): loading a pickle can run any code
# it carries, so they are never read, only named when a directory has nothing else.
PICKLE_WEIGHT_PATTERNS = ("pytorch_model*.bin", "pytorch_model.bin.index.json", "*.pt", "*.pth", "*.ckpt")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint. Only safetensors are ever read (a
    header of JSON and raw tensor bytes, no code); a directory with pickled weights and no safetensors is
    refused, and so is an index that points at anything but .safetensors files beside it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).name != n or not n.endswith(".safetensors")]
        if outside:
            raise ValueError(
                f"{index} lists shard(s) that are not .safetensors files in {path}: {', '.join(outside)}; "
                "only safetensors shards beside the index are read"
            )
        files = [path / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(absent)}")
    else:
        pickled = sorted({f.name for pattern in PICKLE_WEIGHT_PATTERNS for f in path.glob(pattern)})
        if pickled:
            raise ValueError(
                f"{path} holds only pickled PyTorch weights ({', '.join(pickled)}) and no safetensors; "
                "meshtron refuses to unpickle them, because loading a pickle can run any code it "
                "contains. Use the model's safetensors files (most Hugging Face repositories have them), "
                "or convert the checkpoint where you trust it, e.g. "
                "transformers.AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)"
            )
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    return files


def read_hf_config(path: Path) -> dict:
    """The config.json of a transformers checkpoint directory, as a dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist; expected a transformers checkpoint directory")
    return json.loads(config_file.read_text())


def tensor_names(path: Path) -> set[str]:
    """The tensor names of a checkpoint's weight files, read from their headers (numpy's view: no torch)."""
    names: set[str] = set()
    for file in weight_files(path):
        with safe_open(str(file), framework="numpy") as f:
            names.update(f.keys())
    return names


def checkpoint_config(path: str | Path) -> tuple[ModelConfig, str]:
    """(the ModelConfig of `path`/config.json, its model_type). Reads config.json and the weight files'
    headers (is there an lm_head?), never their tensors."""
    path = Path(path)
    hf_config = read_hf_config(path)
    cfg = config_from_hf(hf_config)
    if not cfg.tie_embeddings and HEAD not in tensor_names(
        path
    ):  # no lm_head: tied to the embedding, as transformers does
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    return cfg, hf_config["model_type"]
