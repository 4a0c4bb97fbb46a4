"""A tokenizer's Hugging Face files beside its tokenizer.json: special tokens and the chat template.

transformers keeps what tokenizer.json does not say in files beside it, and has moved the chat template
between them over its versions:

  chat_template.jinja      the template's text (transformers 5, and 4.x since 4.47's save_pretrained)
  chat_template.json       {"chat_template": ...} (processors of transformers 4.4x)
  tokenizer_config.json    the special tokens (bos, eos, pad, added_tokens_decoder) and, before the
                           .jinja file, the template under "chat_template"
  special_tokens_map.json  the special tokens again (transformers 4; 5 no longer writes it)

A template is read from the first of those that has one, in that order (transformers' tokenizer lets the
.jinja file override tokenizer_config.json's key). These files travel with the tokenizer: `prepare-data`
copies them beside the dataset's tokenizer.json, checkpoints carry them, and `meshtron export` writes them
back in transformers' current form (`current_form`), so AutoTokenizer loads the tokens and template it
was given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# In the order a chat template is looked for.
COMPANIONS = (CHAT_TEMPLATE_JINJA, CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)


def companion_files(folder: str | Path) -> dict[str, str]:
    """The COMPANIONS present in `folder`, name -> text."""
    folder = Path(folder)
    return {n: (folder / n).read_text(encoding="utf-8") for n in COMPANIONS if (folder / n).is_file()}


def _json(files: Mapping[str, str], name: str) -> dict[str, Any]:
    """File `name` of `files` parsed as a JSON object ({} when absent); ValueError naming it if malformed."""
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} holds {type(value).__name__}, expected a JSON object")
    return value


def tokenizer_config(files: Mapping[str, str]) -> dict[str, Any]:
    """tokenizer_config.json of `files`, parsed ({} when there is none)."""
    return _json(files, TOKENIZER_CONFIG)


def _default_template(value: Any) -> str | None:
    """A chat_template value: a string, or transformers' list of named templates (its "default" one)."""
    if isinstance(value, list):
        value = next(
            (t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return value if isinstance(value, str) and value else None


def chat_template(files: Mapping[str, str]) -> str | None:
    """The chat template of `files` (companion_files), from the first form that has one; None if none."""
    if files.get(CHAT_TEMPLATE_JINJA):
        return files[CHAT_TEMPLATE_JINJA]
    for name in (CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG):
        template = _default_template(_json(files, name).get("chat_template"))
        if template is not None:
            return template
    return None


def missing_template_hint(folder: Path) -> str:
    """What to do when `folder` holds no chat template: where one can be put."""
    return (
        f"{folder} has no chat template (looked for {CHAT_TEMPLATE_JINJA}, {CHAT_TEMPLATE_JSON} and a "
        f'"chat_template" key in {TOKENIZER_CONFIG}): this tokenizer cannot render chat data. Use the '
        "tokenizer of the model's chat or instruct variant, or write the template's Jinja text to "
        f"{folder / CHAT_TEMPLATE_JINJA} (what transformers' save_pretrained writes after "
        "`tokenizer.chat_template = ...`)"
    )


def current_form(files: Mapping[str, str]) -> dict[str, str]:
    """`files` as transformers 5's save_pretrained writes them: the chat template (from whichever form
    held it) in chat_template.jinja alone, no longer in tokenizer_config.json; chat_template.json gone."""
    config, template = tokenizer_config(files), chat_template(files)
    if isinstance(config.get("chat_template"), list) and CHAT_TEMPLATE_JINJA not in files:
        return dict(files)  # named templates: transformers 5 still reads them there, every one of them
    out = {n: text for n, text in files.items() if n != CHAT_TEMPLATE_JSON}
    if "chat_template" in config:
        config.pop("chat_template")
        out[TOKENIZER_CONFIG] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    if template is not None:
        out[CHAT_TEMPLATE_JINJA] = template
    return out
