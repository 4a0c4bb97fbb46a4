"""`model.init_from = "DIR"`: the run's [model] keys come from the checkpoint's config.json.

Called while the config is merged (checks.load_config), before any process starts, and torch-free:
  - the architecture comes from DIR/config.json (huggingface.py's mapping, the head tied when the checkpoint
    has no lm_head);
  - a [model] key also given in the file or on the command line may only repeat the checkpoint's value
    (0 for a size that 0 derives, e.g. head_dim=0, matches what it derives); a different one is refused,
    naming both values. TRAINING_KEYS are not architecture (they shape the training, not the weights)
    and may be set freely;
  - `model.name` with `model.init_from` is refused unless the preset's architecture is the checkpoint's,
    key for key; the name is then only the run's label.
The weights load later, into the parallel layout (init_from.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from meshtron.config.huggingface import checkpoint_config
from meshtron.config.loading import model_preset
from meshtron.config.schema import ConfigError, ModelConfig

# [model] keys that shape the training but not the weights or the architecture: free with init_from
# (mtp_depth: how many of the checkpoint's multi-token prediction modules to train, if it ships them).
TRAINING_KEYS = frozenset(
    {"capacity_factor", "z_loss_coef", "aux_loss_coef", "balance_loss", "router_bias_rate", "mtp_depth"}
)


# Keys that are labels, not architecture.
LABELS = ("name", "init_from")


# Sizes whose 0 means "derived from the others": 0 matches the checkpoint when it derives the same.
DERIVED_BY_ZERO = {
    "n_kv_heads": "kv_heads",
    "head_dim": "head_size",
    "moe_ffn_dim": "expert_ffn_dim",
    "shared_ffn_dim": "shared_expert_ffn_dim",
}


def _same(key: str, value: Any, cfg: ModelConfig) -> bool:
    """Whether an explicit `key = value` says what the checkpoint's `cfg` says."""
    theirs = getattr(cfg, key)
    if isinstance(theirs, bool) or isinstance(value, bool):
        return value is theirs  # True == 1 in Python, but tie_embeddings=1 is not what a checkpoint says
    if value == theirs:
        return True
    derived = DERIVED_BY_ZERO.get(key)
    if derived is None or not isinstance(value, int):
        return False
    return getattr(dataclasses.replace(cfg, **{key: value}), derived) == getattr(cfg, derived)


def _preset_problem(name: str, cfg: ModelConfig, source: str, explicit: Mapping[str, Any]) -> str | None:
    """Why preset `name` cannot label a run initialised from a checkpoint of architecture `cfg`; the keys
    set beside it (`explicit`, checked against the checkpoint on their own) replace the preset's."""
    preset = model_preset(name)
    differ = [
        f"{key} {preset[key]!r} (preset) vs {getattr(cfg, key)!r}"
        for key in sorted(preset)
        if key not in TRAINING_KEYS
        and key not in LABELS
        and key not in explicit
        and not _same(key, preset[key], cfg)
    ]
    if not differ:
        return None
    return (
        f"model.name={name!r} and model.init_from disagree on the architecture ({'; '.join(differ)} in "
        f"{source}); drop model.name: with model.init_from the checkpoint's config.json defines the model"
    )


def resolve_model_keys(explicit: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """The [model] keys of a run with model.init_from: the checkpoint's architecture, with the explicit
    keys that repeat it, TRAINING_KEYS and any unknown key (left for the config's own check); each
    conflicting key (and a preset of another architecture) is added to `problems`."""
    path = Path(str(explicit["init_from"]))
    source = str(path / "config.json")
    try:
        cfg, _ = checkpoint_config(path)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:  # any unreadable config.json
        problems.append(f"model.init_from={str(path)!r} is not a checkpoint meshtron can start from: {err}")
        return dict(explicit)
    if explicit.get("name"):
        try:
            problem = _preset_problem(str(explicit["name"]), cfg, source, explicit)
        except ConfigError as err:
            problem = "; ".join(err.problems)
        problems += [problem] if problem else []
    keys = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in LABELS}
    for key, value in explicit.items():
        if key in LABELS or key in TRAINING_KEYS or key not in keys:
            keys[key] = value
        elif not _same(key, value, cfg):
            problems.append(
                f"model.{key}={value!r} conflicts with {source}, which gives {key}={keys[key]!r}; "
                f"model.init_from takes the architecture from the checkpoint: remove model.{key}"
            )
    return keys
