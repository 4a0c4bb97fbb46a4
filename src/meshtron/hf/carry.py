"""What an export keeps of what the run was given: the Hugging Face files meshtron does not write itself.

A run knows its model as a ModelConfig and its tokenizer as a tokenizer.json; a Hugging Face directory
says more (the context length, bos/pad ids, generation defaults, the tokenizer's special tokens and chat
template). So each checkpoint carries those files (CARRIED_FILE, name -> text, rank 0 writes it on every
save whatever the layout, so a run resumed on another layout carries them on), and `meshtron export`
writes them back:

  config.json             from model.init_from's: every field meshtron does not change is carried
                          (`exported_config`); a field meshtron computes from its ModelConfig comes from
                          meshtron when it differs from what the checkpoint's own architecture gives
  generation_config.json  model.init_from's, as it is
  the tokenizer's files   tokenizer_config.json, special_tokens_map.json and the chat template
                          (data/tokenizer_files.py): those prepare-data copied beside the data's
                          tokenizer.json, else model.init_from's when its tokenizer.json is the data's
                          (byte for byte: prepare-data copies it so); written in transformers' current
                          form (the template in chat_template.jinja)

A run trained from scratch carries nothing from a model; its config.json's max_position_embeddings is the
trained training.seq_len (meshtron's RoPE has no limit of its own, and tools read this field as the
context the model was trained for), except under llama3 RoPE scaling, whose context is that of its design
(original_max_position_embeddings x factor, which transformers requires to exceed the original).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtron.config.huggingface import config_from_hf, config_to_hf
from meshtron.data.tokenizer import TOKENIZER_FILE
from meshtron.data.tokenizer_files import companion_files, current_form

CARRIED_FILE = "hf_files.json"  # in a checkpoint: {file name: text}
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_FILES = (CONFIG, GENERATION_CONFIG)
DTYPE_KEYS = ("dtype", "torch_dtype")  # the exported weights' dtype, whatever the source's was


def carried_files(init_from: str, tokenizer_path: Path | None) -> dict[str, str]:
    """The files a checkpoint carries for its export: model.init_from's MODEL_FILES, and the tokenizer
    files beside `tokenizer_path` (the data's tokenizer.json; None for bytes) or, when it has none, beside
    model.init_from's tokenizer.json when that is the same file."""
    source = Path(init_from) if init_from else None
    files = {
        n: (source / n).read_text(encoding="utf-8") for n in MODEL_FILES if source and (source / n).is_file()
    }
    if tokenizer_path is None:
        return files
    tokenizer = companion_files(tokenizer_path.parent)
    theirs = source / TOKENIZER_FILE if source else None
    if (
        not tokenizer
        and theirs is not None
        and theirs.is_file()
        and theirs.read_bytes() == tokenizer_path.read_bytes()
    ):
        tokenizer = companion_files(source)
    return {**files, **tokenizer}


def exported_config(ours: dict[str, Any], source: Mapping[str, Any] | None, seq_len: int) -> dict[str, Any]:
    """The config.json to export: `ours` (config_to_hf of the trained ModelConfig) with every field of
    `source` (model.init_from's config.json) carried that meshtron did not change, i.e. whose value in
    `ours` is what meshtron writes for the source's own architecture too; without a source, `ours` with
    the trained context as max_position_embeddings (module docstring)."""
    if source is None:
        return {
            **ours,
            "max_position_embeddings": ours["max_position_embeddings"] if ours["rope_scaling"] else seq_len,
        }
    try:
        theirs_as_ours = config_to_hf(config_from_hf(source), ours["dtype"])
    except ValueError:  # a source meshtron cannot read: nothing of it is known to be unchanged
        return {**source, **ours}
    # A key config_to_hf does not write (eos_token_id from the tokenizer) is only meshtron's default.
    changed = {k for k, v in ours.items() if k in theirs_as_ours and theirs_as_ours[k] != v}
    kept = {k: v for k, v in ours.items() if k in changed or k not in source or k in DTYPE_KEYS}
    return {**source, **kept}


def write_carried(files: Mapping[str, str], out: Path, seq_len: int) -> list[str]:
    """Write into the export `out` (config.json already there, as meshtron computes it) the config merged
    with the carried one, and the carried generation config and tokenizer files; returns the names of the
    files written from what was carried."""
    path = out / CONFIG
    source = json.loads(files[CONFIG]) if CONFIG in files else None
    config = exported_config(json.loads(path.read_text()), source, seq_len)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = [CONFIG] if source is not None else []
    tokenizer = current_form({n: t for n, t in files.items() if n not in MODEL_FILES})
    for name, text in {**{n: files[n] for n in (GENERATION_CONFIG,) if n in files}, **tokenizer}.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(name)
    return written
