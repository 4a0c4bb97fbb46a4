"""What a run leaves for use outside training: the files each checkpoint carries so that it can be
exported or decoded alone (the resolved config, the tokenizer, what the export keeps of the Hugging Face
files the run was given), and the sample printed at the end of a run, so that a new user sees what the
model learned."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.save_load import checkpoint_model, complete_checkpoints
from meshtron.config.schema import Config
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData
from meshtron.data.mixture import Mixture
from meshtron.data.tokenizer import TOKENIZER_FILE, HFTokenizer, tokenizer_json
from meshtron.hf.carry import CARRIED_FILE, carried_files
from meshtron.models.generate import generate
from meshtron.models.llama import Transformer
from meshtron.observe.records import CONFIG_FILE, config_text

PROMPT_TOKENS = 16  # the prompt: the first tokens of the validation data (or of the training data)


def checkpoint_files(cfg: Config, world_size: int, dataset: PreparedData | Mixture) -> dict[str, bytes]:
    """config.toml (the config as run, as observe/records.py writes it into run.dir; inside the checkpoint too, as
    run.dir's is rewritten by every start and checkpoint.dir may be elsewhere), tokenizer.json, and the
    Hugging Face files an export writes back (hf/carry.py), when there are any."""
    tok = dataset.load_tokenizer()
    files = {
        CONFIG_FILE: (config_text(cfg, world_size) + "\n").encode(),
        TOKENIZER_FILE: tokenizer_json(tok).encode(),
    }
    carried = carried_files(cfg.model.init_from, tok.path if isinstance(tok, HFTokenizer) else None)
    if carried:
        files[CARRIED_FILE] = json.dumps(carried, indent=1, sort_keys=True).encode()
    return files


def sample_model(cfg: Config, world_size: int, model: Transformer, root: Path) -> Transformer | None:
    """The trained model on one device: this rank's own when it holds all of it (one rank; decoding
    leaves it as it was), else the final checkpoint's (a run that checkpoints writes one at its last
    step); None otherwise."""
    if world_size == 1:
        return model
    found = complete_checkpoints(root) if cfg.checkpoint.every else []
    return checkpoint_model(found[-1].path, cfg.model) if found else None


def print_sample(
    cfg: Config, world_size: int, model: Transformer, root: Path, data: PreparedData | Mixture
) -> None:
    """Rank 0, after training: run.sample_tokens greedy tokens after the first tokens of `data` (the
    validation data when there is some: text the model has not trained on)."""
    try:
        single = sample_model(cfg, world_size, model, root)
        tok = data.load_tokenizer()
    except (CheckpointError, DataError) as err:  # the run itself succeeded; say why there is no sample
        print(f"meshtron: no sample: {err}", flush=True)
        return
    if single is None:
        print(
            "meshtron: no sample: a multi-rank run samples from its final checkpoint (set checkpoint.every)"
        )
        return
    first = data.sources[0] if isinstance(data, Mixture) else data  # a mixture's prompt: its first source's
    prompt = [int(t) for t in first.tokens[:PROMPT_TOKENS]]
    new = generate(single, prompt, cfg.run.sample_tokens, eos_id=tok.eos_id)[0].tolist()
    print(
        f"meshtron: sample (greedy, {len(new)} tokens after the data's first {len(prompt)}): "
        f"{tok.decode(prompt)!r} -> {readable(tok.decode, new, data.vocab_size)!r}",
        flush=True,
    )


def readable(decode: Callable[[list[int]], str], ids: list[int], vocab_size: int) -> str:
    """`ids` as text; an id past the tokenizer's vocabulary (a model's vocab_size may be larger, and a
    short run can still pick one) shows as <id N> instead of failing the end of a finished run."""
    text, run = [], []
    for i in [*ids, None]:
        if i is not None and i < vocab_size:
            run.append(i)
            continue
        text.append(decode(run) if run else "")
        run = []
        if i is not None:
            text.append(f"<id {i}>")
    return "".join(text)
