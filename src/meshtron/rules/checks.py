"""From files to a checked config: every problem found at once, each with its fix, before any process
starts (and once more inside the job, where the world size and the device are known).

  load_config        TOML + overrides (config/loading.py); with model.init_from, the checkpoint's architecture
                     (config/init_from.py); config_notes: the keys that win over a preset
  validate           every problem: the fields' own ranges and options, then each package's rules
  not_yet_supported  valid layouts this version cannot run yet, each named by the code that will run it
  check              raise ConfigError listing the problems (or else the unsupported parts); else the config

The rules live beside the code that needs them, in torch-free modules, so that `meshtron plan` checks
every candidate layout with the rules `meshtron train` applies, without importing torch:

  config/layout.py           the dims multiply to the world size; ep folds into dp_shard x cp
  rules/model.py     attention, rotary and routing sizes
  rules/parallel.py   tensor, context and expert parallel; the data-parallel engines
  rules/data.py       the batch split; validation data
  rules/pipeline.py   the layer split, the schedule, micro-batches per step, DualPipeV's overlapped pairs
  rules/training.py      checkpoints of the layout; recompute under compile; float8 sizes; Weights & Biases
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from meshtron.config.init_from import resolve_model_keys
from meshtron.config.loading import build_config, load_toml
from meshtron.config.schema import Config, refuse
from meshtron.rules.data import (
    batch_problems,
    command_line_first,
    mixture_problems,
    validation_problems,
)
from meshtron.rules.model import model_problems, moe_problems, preset_first, preset_notes
from meshtron.rules.parallel import (
    context_parallel_problems,
    data_parallel_unsupported,
    expert_parallel_problems,
    expert_parallel_unsupported,
    layout_problems,
    tensor_parallel_problems,
)
from meshtron.rules.pipeline import pipeline_problems
from meshtron.rules.training import (
    diloco_problems,
    float8_problems,
    mtp_problems,
    muon_unsupported,
    profile_problems,
    recompute_problems,
    replica_group_problems,
    wandb_problems,
)
from meshtron.utils.words import suggest


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """A config from a TOML file (or none) and `--section.key=value` overrides, its model from a preset,
    or from the checkpoint model.init_from names; unchecked (see `check`). An override that chooses the
    training (or validation) data replaces the file's other way of naming it (rules/data.py)."""
    raw = load_toml(path) if path is not None else {}
    return build_config(
        preset_first(command_line_first(raw, overrides), overrides), overrides, resolve_model_keys
    )


def config_notes(path: str | Path | None, overrides: Sequence[str]) -> list[str]:
    """What a user should know about how `load_config` merged the file and the overrides: the keys that
    win over a preset (rules/model.py)."""
    raw = load_toml(path) if path is not None else {}
    return preset_notes(raw, overrides, None if path is None else str(path))


def validate(cfg: Config, world_size: int = 1, device_type: str | None = None) -> list[str]:
    """Every problem of `cfg` for a job of `world_size` ranks (on `device_type`, once known), each with
    its fix: the fields' own rules first; the packages' rules divide by the sizes, so they wait for them."""
    problems, sizes = field_problems(cfg)
    if sizes:
        return problems
    problems += model_problems(cfg.model) + moe_problems(cfg.model)
    problems += layout_problems(cfg, world_size)
    problems += tensor_parallel_problems(cfg)
    problems += context_parallel_problems(cfg)
    problems += expert_parallel_problems(cfg)
    problems += batch_problems(cfg, world_size)
    problems += pipeline_problems(cfg, world_size, device_type)
    problems += validation_problems(cfg) + mixture_problems(cfg)
    problems += wandb_problems(cfg) + recompute_problems(cfg) + float8_problems(cfg, device_type)
    problems += mtp_problems(cfg)
    problems += (
        profile_problems(cfg) + diloco_problems(cfg, world_size) + replica_group_problems(cfg, world_size)
    )
    return problems


def not_yet_supported(cfg: Config, world_size: int = 1) -> list[str]:
    """Valid layouts that this version cannot run yet."""
    return (
        expert_parallel_unsupported(cfg)
        + data_parallel_unsupported(cfg, world_size)
        + muon_unsupported(cfg, world_size)
    )


def check(cfg: Config, world_size: int = 1, device_type: str | None = None) -> Config:
    """Raise ConfigError listing every problem, or, in a valid config, every part this version cannot run
    yet; otherwise return cfg."""
    refuse(validate(cfg, world_size, device_type) or not_yet_supported(cfg, world_size))
    return cfg


def field_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(every field's own problem: an enumerated option that is not one of its options, a number outside
    its range; those of them about sizes the feature rules divide by)."""
    problems, sizes = [], []
    for section in dataclasses.fields(Config):
        values = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(values))
        for f in dataclasses.fields(values):
            where, value = f"{section.name}.{f.name}", getattr(values, f.name)
            if typing.get_origin(hints[f.name]) is Literal and value not in typing.get_args(hints[f.name]):
                known = [str(o) for o in typing.get_args(hints[f.name])]
                hint = suggest(str(value), known, list_known=False)
                problems.append(f"{where}={value!r} is not one of {', '.join(known)}{hint}")
            if "ok" in f.metadata and not f.metadata["ok"](value):
                problems.append(f"{where}={value} {f.metadata['says']}")
                sizes += [problems[-1]] if f.metadata["size"] else []
    return problems, sizes
