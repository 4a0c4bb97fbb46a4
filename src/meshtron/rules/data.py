"""What the data needs of the batch and the validation options: the one batch rule (every data-parallel
rank takes an equal slice of the global batch and cuts it into equal micro-batches), and how the
validation options fit together. Torch-free (checks.py gathers every package's rules)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meshtron.config.loading import section_overrides
from meshtron.config.schema import Config

# [data] keys that name one thing two ways (the rules below refuse both): the command line's choice of
# one replaces the config file's other, as an override replaces the file's value of its own key.
ALTERNATIVES = (("path", "sources"), ("val_path", "val_fraction"))
NOTHING = ("", "default", 0, [])  # a value that chooses nothing (the field's default), so replaces nothing


def batch_split_problem(global_batch: int, micro_batch: int, dp_size: int) -> str | None:
    """The one rule of splitting a global batch: every data-parallel rank takes an equal slice of it and
    cuts its slice into equal micro-batches, so global_batch must be a multiple of micro_batch * dp."""
    if micro_batch >= 1 and global_batch % (micro_batch * dp_size) == 0:
        return None
    return (
        f"training.global_batch={global_batch} is not divisible by micro_batch*dp = {micro_batch}*{dp_size}; "
        f"use a global_batch that is a multiple of {max(micro_batch, 1) * dp_size}"
    )


def batch_problems(cfg: Config, world_size: int) -> list[str]:
    """The batch rule for the data-parallel ranks of a job of `world_size` ranks."""
    dp = cfg.parallel.dp_for(world_size)
    problem = batch_split_problem(cfg.training.global_batch, cfg.training.micro_batch, dp)
    return [problem] if problem else []


def micro_batches_per_step(global_batch: int, micro_batch: int, dp_size: int) -> int:
    """How many micro-batches each data-parallel rank runs per optimizer step."""
    problem = batch_split_problem(global_batch, micro_batch, dp_size)
    if problem:
        raise ValueError(problem)
    return global_batch // (micro_batch * dp_size)


def validation_problems(cfg: Config) -> list[str]:
    """How the validation options fit together (their ranges are on the fields)."""
    d, t = cfg.data, cfg.training
    problems = []
    if d.val_fraction > 0 and d.val_path:
        problems.append(
            f"data.val_fraction={d.val_fraction} and data.val_path={d.val_path!r} both name validation "
            "data; keep one (--data.val_fraction=0 or --data.val_path= on the command line unsets one)"
        )
    if t.eval_every > 0 and not (d.val_fraction > 0 or d.val_path):
        problems.append(
            f"training.eval_every={t.eval_every} needs validation data; set data.val_fraction (e.g. 0.01) "
            "or data.val_path, or training.eval_every=0"
        )
    return problems


def command_line_first(raw: Mapping[str, Any], overrides: Sequence[str]) -> Mapping[str, Any]:
    """The config file's mapping `raw` without the [data] keys whose alternative an override chooses
    (e.g. `--data.sources=[...]` over the file's data.path: the command line wins)."""
    given = section_overrides("data", overrides)
    data = raw.get("data")
    if not isinstance(data, Mapping):
        return raw
    replaced = {
        other
        for pair in ALTERNATIVES
        for key, other in (pair, pair[::-1])
        if key in given and other not in given and given[key] not in NOTHING
    }
    return {**raw, "data": {k: v for k, v in data.items() if k not in replaced}}


def mixture_problems(cfg: Config) -> list[str]:
    """How `[[data.sources]]` fits with the other data options (its tokenizers are checked on opening)."""
    d = cfg.data
    if not d.sources:
        return []
    problems = []
    if d.path != "default":
        problems.append(
            f"data.path={d.path!r} and data.sources both name the training data; keep one: remove data.path "
            "(--data.path= on the command line unsets it)"
        )
    if d.val_path:
        problems.append("data.val_path with data.sources: hold out each source's tail with data.val_fraction")
    for i, source in enumerate(d.sources):
        if not source.path:
            problems.append(f"data.sources[{i}] has no path; give each source a prepared dataset directory")
        if not source.weight > 0:
            problems.append(
                f"data.sources[{i}].weight={source.weight} must be positive (a share of the samples)"
            )
    paths = [s.path for s in d.sources]
    if len(set(paths)) < len(paths):
        problems.append("data.sources names a path twice; give each dataset once, with its whole weight")
    return problems
