"""A Config from TOML files and `--section.key=value` overrides: presets, values coerced to each field's
type (every problem collected), `model.init_from`'s keys merged. rules/checks.py's `load_config` builds
with this and then checks the result against every feature's rules."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from meshtron.config.presets import PRESETS
from meshtron.config.schema import V_SCHEDULES, Config, ConfigError
from meshtron.utils.words import suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def model_preset(name: str) -> dict[str, Any]:
    """The architecture of a named model; explicit keys override it."""
    if name not in PRESETS:
        raise ConfigError([f"model.name={name!r} is not a known preset{suggest(name, sorted(PRESETS))}"])
    return dict(PRESETS[name])


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Accept `value` for a field of type `tp`, or record why not. A Literal field takes its options' type
    here; which options exist is `validate`'s check, so it is reported with the other problems."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _coerce(value, type(typing.get_args(tp)[0]), where, problems)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{where} must be a list of {_type_name(item_tp)}, got {value!r}")
            return None
        return [_coerce(v, item_tp, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _coerce_table(value, tp, where, problems)
    accepts = {
        bool: (lambda v: isinstance(v, bool), "true or false"),
        int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
        str: (lambda v: isinstance(v, str), "a string"),
    }
    if tp not in accepts:
        raise TypeError(f"unsupported config field type {tp!r} for {where}")
    ok, what = accepts[tp]
    if ok(value):
        return float(value) if tp is float else value
    problems.append(f"{where} must be {what}, got {value!r}")
    return None


def _coerce_table(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """A TOML table (e.g. one `[[data.sources]]` entry) as the dataclass `tp`, each key coerced."""
    types_of = typing.get_type_hints(tp)
    if not isinstance(value, Mapping):
        problems.append(f"{where} must be a table with keys {', '.join(types_of)}")
        return None
    unknown = [f"unknown key {where}.{k}{suggest(k, list(types_of))}" for k in value if k not in types_of]
    problems += unknown
    kwargs = {k: _coerce(v, types_of[k], f"{where}.{k}", problems) for k, v in value.items() if k in types_of}
    return tp(**{k: v for k, v in kwargs.items() if v is not None})


def parse_override(text: str) -> tuple[str, str, Any]:
    """`--section.key=value` -> (section, key, value); the value is read as a TOML literal when it is one."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(
            [f"override {text!r} must look like --section.key=value (e.g. --training.steps=20)"]
        )
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as `bf16` or a path
    return section, key, value


def section_overrides(section: str, overrides: Sequence[str]) -> dict[str, Any]:
    """key -> value of the well-formed `--section.key=value` overrides of `section` (the others: refused later)."""
    parsed = []
    for text in overrides:
        with contextlib.suppress(ConfigError):
            parsed.append(parse_override(text))
    return {key: value for where, key, value in parsed if where == section}


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        problem = f"config file {str(path)!r} does not exist; pass an existing .toml file (presets live in configs/)"
        raise ConfigError([problem])
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"{path} is not valid TOML: {err}"]) from None


# Keys a Python field cannot be named (a keyword) -> the field's name.
KEY_ALIASES = {("checkpoint", "async"): "async_save"}

# Where [model] keys come from when model.init_from names a checkpoint: (the explicit [model] keys,
# problems) -> the keys to build from (checks.load_config passes the Hugging Face reader, config/init_from.py).
ModelSource = Callable[[Mapping[str, Any], list[str]], dict[str, Any]]


def _merge(
    raw: Mapping[str, Any], overrides: Sequence[str], problems: list[str], model_source: ModelSource | None
) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} from the file, then the overrides, then the model preset under them (or,
    with model.init_from, the checkpoint's architecture from `model_source`, which they may only repeat)."""
    merged: dict[str, dict[str, Any]] = {}
    sections = [f.name for f in dataclasses.fields(Config)]

    def put(section: str, key: str | None, value: Any, origin: str) -> None:
        if section not in sections:
            problems.append(f"unknown section [{section}] in {origin}{suggest(section, sections)}")
            return
        if key is None:
            if not isinstance(value, Mapping):
                problems.append(f"[{section}] in {origin} must be a table of keys")
                return
            for k, v in value.items():
                put(section, k, v, origin)
            return
        merged.setdefault(section, {})[KEY_ALIASES.get((section, key), key)] = value

    for section, value in raw.items():
        put(section, None, value, "the config file")
    for text in overrides:
        try:
            section, key, value = parse_override(text)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        put(section, key, value, f"override {text!r}")
    model_values = merged.get("model", {})
    if isinstance(model_values.get("init_from"), str) and model_values["init_from"]:
        if model_source is None:
            problems.append(
                "model.init_from needs the checkpoint's architecture: load with checks.load_config"
            )
        else:
            merged["model"] = model_source(model_values, problems)
    elif model_values.get("name", ""):
        try:
            merged["model"] = {**model_preset(model_values["name"]), **model_values}
        except ConfigError as err:
            problems.extend(err.problems)
    parallel = merged.get("parallel", {})
    if parallel.get("pp_schedule") in V_SCHEDULES and "vpp" not in parallel:
        parallel["vpp"] = 2  # a V holds two chunks per rank by definition
    return merged


def build_config(
    raw: Mapping[str, Any], overrides: Sequence[str] = (), model_source: ModelSource | None = None
) -> Config:
    """Merge a TOML mapping, a model preset and overrides into a typed Config; type errors are collected."""
    problems: list[str] = []
    merged = _merge(raw, overrides, problems, model_source)
    built: dict[str, Any] = {}
    for section, section_cls in typing.get_type_hints(Config).items():
        types_of = typing.get_type_hints(section_cls)
        kwargs: dict[str, Any] = {}
        for key, value in merged.get(section, {}).items():
            if key not in types_of:
                problems.append(f"unknown key {section}.{key}{suggest(key, list(types_of))}")
                continue
            coerced = _coerce(value, types_of[key], f"{section}.{key}", problems)
            if coerced is not None:
                kwargs[key] = coerced
        built[section] = section_cls(**kwargs)
    if problems:
        raise ConfigError(problems)
    return Config(**built)
