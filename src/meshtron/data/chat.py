"""Chat data: conversations rendered with the tokenizer's own chat template; only assistant turns count.

A chat file is `.jsonl` with one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}`.
Each conversation becomes one document of the prepared dataset, followed by its end-of-document token,
with a loss mask beside its tokens (`loss_mask.bin`, one byte per token: 1 where the token is a target
that counts):

  rendering         the chat template beside the tokenizer.json (chat_template.jinja, chat_template.json
                    or tokenizer_config.json's key: tokenizer_files.py), a Jinja template rendered as
                    transformers renders it (`messages`, `bos_token`, `eos_token`, `add_generation_prompt`,
                    in a sandboxed environment), then tokenized with the template's special tokens
                    recognised and no tokens added
  what counts       assistant turn i covers the characters the template adds between the render of the
                    turns before it with the generation prompt and the render that ends with it (its
                    content and the template's end-of-turn marks); a token counts when it starts inside
                    such a span. Prompts, system text and the document separator do not count.

This needs each render to be a prefix of the next, which chat templates are built for; a template that
rewrites earlier turns is refused by name.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshtron.data import DataError
from meshtron.data.tokenizer_files import (
    chat_template,
    companion_files,
    missing_template_hint,
    tokenizer_config,
)


def _special(config: dict[str, Any], key: str) -> str:
    """A special token's text from tokenizer_config.json (a string, or transformers' AddedToken dict)."""
    value = config.get(key) or ""
    return value.get("content", "") if isinstance(value, dict) else str(value)


class ChatTemplate:
    """A tokenizer.json with the chat template beside it (tokenizer_files.py)."""

    def __init__(self, tokenizer_path: str | Path):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        path = Path(tokenizer_path)
        folder = path if path.is_dir() else path.parent
        try:
            files = companion_files(folder)
            template, config = chat_template(files), tokenizer_config(files)
        except ValueError as err:
            raise DataError(f"--chat reads the chat template beside the tokenizer: {folder}/{err}") from None
        if template is None:
            raise DataError(missing_template_hint(folder))
        # As transformers renders templates: loop controls, `tojson`, `raise_exception`, `strftime_now`.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.specials = {
            "bos_token": _special(config, "bos_token"),
            "eos_token": _special(config, "eos_token"),
        }
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json" if path.is_dir() else path))
        self.tokenizer.encode_special_tokens = False  # the template's own special tokens are tokens
        self.tokenizer.post_processor = None  # nothing added, and offsets as they are (not trimmed)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=messages, add_generation_prompt=generation_prompt, **self.specials
            )
        except TemplateError as err:
            raise DataError(f"the chat template cannot render a conversation: {err}") from None

    def encode(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of one conversation: 1 for the tokens of assistant turns."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, turn = self.render(messages[:i], generation_prompt=True), self.render(messages[: i + 1])
            if not (turn.startswith(prompt) and text.startswith(turn)):
                raise DataError(
                    "the chat template renders earlier turns differently once later ones follow, so the "
                    "assistant turns cannot be found in the rendered conversation"
                )
            spans.append((len(prompt), len(turn)))
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        mask = [int(any(s <= first < e for s, e in spans)) for first, _ in encoding.offsets]
        return encoding.ids, mask


def _raise(message: str) -> None:
    raise DataError(f"the chat template refused a conversation: {message}")


def conversations(files: list[Path]) -> Iterator[tuple[int, Path, list[dict[str, Any]]]]:
    """(files finished before it, its file, its messages) for each conversation of the .jsonl `files`."""
    for done, path in enumerate(files):
        if path.suffix != ".jsonl":
            raise DataError(f'{path}: --chat reads .jsonl files with a "messages" list per line')
        with open(path, encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield done, path, _messages(line, f"{path}:{lineno}")


def _messages(line: str, where: str) -> list[dict[str, Any]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}); fix or remove the line") from e
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: expected a JSON object with a non-empty "messages" list')
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f'{where}: each message needs a "role" and a "content" string, got {m!r}')
    return messages


def chat_documents(
    files: list[Path], template: ChatTemplate, dtype: np.dtype
) -> Iterator[tuple[int, str, np.ndarray, np.ndarray]]:
    """(files done, file's absolute name, token ids, loss mask) per conversation, for the dataset writer."""
    for done, path, messages in conversations(files):
        ids, mask = template.encode(messages)
        yield done, str(path.resolve()), np.asarray(ids, dtype=dtype), np.asarray(mask, dtype=np.uint8)
