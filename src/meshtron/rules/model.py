"""What the model's own code needs of its options: attention and rotary sizes (models/llama.py), routing (models/moe.py);
and which keys win over a preset `model.name` names.

Torch-free, like every package's model.py, so that a config can be checked (and `meshtron plan` can
search layouts) without importing torch; checks.py gathers the rules of every package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meshtron.config.layout import divisors
from meshtron.config.loading import section_overrides
from meshtron.config.presets import PRESETS
from meshtron.config.schema import ModelConfig


def latent_attention_problems(cfg: ModelConfig) -> list[str]:
    """What multi-head latent attention (kv_lora_rank > 0) needs of its sizes."""
    problems = []
    if cfg.qk_rope_head_dim <= 0 or cfg.qk_rope_head_dim % 2:
        problems.append(
            f"model.qk_rope_head_dim={cfg.qk_rope_head_dim}: latent attention's rotary key needs an even, "
            "positive size (DeepSeek-V3: 64)"
        )
    if cfg.v_head_dim <= 0:
        problems.append(f"model.v_head_dim={cfg.v_head_dim} must be positive under latent attention")
    if cfg.qk_norm or cfg.qkv_bias:
        problems.append("model.qk_norm and model.qkv_bias do not apply to latent attention; set them false")
    if cfg.n_kv_heads not in (0, cfg.n_heads):
        problems.append(
            f"model.n_kv_heads={cfg.n_kv_heads}: under latent attention every head has its own keys and "
            "values (up-projected from the latent); leave n_kv_heads at 0"
        )
    return problems


def model_problems(cfg: ModelConfig) -> list[str]:
    """What the attention and rotary embedding need of the model's sizes."""
    if cfg.is_mla:
        return latent_attention_problems(cfg) + _rope_problems(cfg)
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
    return problems + _rope_problems(cfg)


def _rope_problems(cfg: ModelConfig) -> list[str]:
    if cfg.rope_scaling == "llama3" and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        return ["model.rope_high_freq_factor must exceed model.rope_low_freq_factor for llama3 scaling"]
    if cfg.rope_scaling == "yarn" and cfg.rope_beta_fast <= cfg.rope_beta_slow:
        return ["model.rope_beta_fast must exceed model.rope_beta_slow for YaRN scaling"]
    return []


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


def _model_keys(raw: Mapping[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The [model] keys of the config file's mapping `raw`, and those the overrides set."""
    table = raw.get("model")
    file_keys = dict(table) if isinstance(table, Mapping) else {}
    given = section_overrides("model", overrides)
    return file_keys, given


def _preset_of(file_keys: dict[str, Any], given: dict[str, Any]) -> tuple[str, str] | None:
    """(the preset's name, where it was named: "file" or "command line"), unless there is none to apply
    (no name, an unknown one: reported when the config is built, or model.init_from's architecture)."""
    if given.get("init_from") or (file_keys.get("init_from") and "init_from" not in given):
        return None
    name, where = (given["name"], "command line") if "name" in given else (file_keys.get("name"), "file")
    return (name, where) if isinstance(name, str) and name in PRESETS else None


def preset_first(raw: Mapping[str, Any], overrides: Sequence[str]) -> Mapping[str, Any]:
    """The config file's mapping `raw` without the [model] keys a preset named on the command line sets:
    `--model.name=NAME` asks for that model, not the file's with its name (docs/training.md#presets).
    A preset named in the file is overridden by the file's keys beside it; the command line's
    `--model.KEY` override either."""
    file_keys, given = _model_keys(raw, overrides)
    preset = _preset_of(file_keys, given)
    if preset is None or preset[1] == "file":
        return raw
    return {**raw, "model": {k: v for k, v in file_keys.items() if k not in PRESETS[preset[0]]}}


def preset_notes(raw: Mapping[str, Any], overrides: Sequence[str], path: str | None) -> list[str]:
    """One line saying which keys win over the preset `model.name` names (and, for a preset named on the
    command line, which of the file's [model] keys it replaced); none when nothing changes it."""
    file_keys, given = _model_keys(raw, overrides)
    preset = _preset_of(file_keys, given)
    if preset is None:
        return []
    name, where = preset
    values, origin = PRESETS[name], path or "the config file"
    winners = {k: (v, "command line") for k, v in given.items() if k in values and v != values[k]}
    replaced = []
    for k, v in file_keys.items():
        if k in given or k not in values or v == values[k]:
            continue
        if where == "file":
            winners[k] = (v, origin)
        else:
            replaced.append(f"{k}={v!r}")
    parts = [
        f"{k}={v!r} ({source}) in place of its {values[k]!r}" for k, (v, source) in sorted(winners.items())
    ]
    if replaced:
        parts.append(f"the preset's values replace {origin}'s {', '.join(replaced)}")
    if not parts:
        return []
    named = "on the command line" if where == "command line" else f"in {origin}"
    return [f"note: model.name={name!r} (a preset, named {named}): " + "; ".join(parts)]
