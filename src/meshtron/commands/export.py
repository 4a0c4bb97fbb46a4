"""A training checkpoint of any layout on one device: `meshtron export` (to a Hugging Face directory) and
`meshtron generate` read checkpoints through here.

A checkpoint directory (`step-NNNNNNNN/`) carries what rebuilding the model needs besides its state: the
run's resolved `config.toml` (the model's shape), its `tokenizer.json` (train/sample.py names both) and,
when the run was given them, the Hugging Face files the export writes back (`hf_files.json`: hf/carry.py).
Its parameters are stored as row and tensor-/expert-parallel blocks of the logical tensors, so
`checkpoint_model` assembles each whole, in one process, whatever layout wrote them. A checkpoint from
before they carried the config uses its run directory's config.toml, or `--config`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from meshtron import hf
from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.integrity import file_problems
from meshtron.checkpoint.save_load import (
    check_format,
    checkpoint_model,
    complete_checkpoints,
    read_model_tensor,
)
from meshtron.config.loading import build_config, load_toml
from meshtron.config.schema import Config, ConfigError, ModelConfig
from meshtron.data import DataError
from meshtron.data.tokenizer import TOKENIZER_FILE, HFTokenizer, Tokenizer, tokenizer_json
from meshtron.hf.carry import CARRIED_FILE, write_carried
from meshtron.hf.stream import DEFAULT_MAX_SHARD_BYTES
from meshtron.hf.weights import save_streamed_model, stored_shapes
from meshtron.models.llama import Transformer
from meshtron.train.sample import CONFIG_FILE

HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a checkpoint (step-NNNNNNNN/), else the newest complete one under it (a
    checkpoints directory, or a run directory holding checkpoints/) whose files match its manifest."""
    path = Path(path)
    if (path / ".metadata").is_file():
        if path.name.endswith(".tmp"):
            raise CheckpointError(f"{path} is a checkpoint whose writing never finished; use a complete one")
        problems = file_problems(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = complete_checkpoints(root)
    if not found and (path / "metrics.jsonl").is_file():
        raise CheckpointError(
            f"the run in {path} saved no checkpoint: runs save one every checkpoint.every steps (0, the "
            "default, saves none; any N > 0 also saves one at the end): train again with "
            "--checkpoint.every=N"
        )
    if not found:
        raise CheckpointError(
            f"{path} is neither a checkpoint (a step-NNNNNNNN directory) nor a directory holding complete "
            "ones; pass a run's checkpoints directory (checkpoint.dir, default <run.dir>/checkpoints)"
        )
    for info in reversed(found):
        problems = file_problems(info.path)
        if not problems:
            return info.path
        print(
            f"meshtron: warning: skipping corrupt checkpoint {info.path}: {'; '.join(problems)}",
            file=sys.stderr,
        )
    which = (
        f"the only checkpoint in {root} is"
        if len(found) == 1
        else f"all {len(found)} checkpoints in {root} are"
    )
    raise CheckpointError(f"{which} corrupt")


def checkpoint_config(step_dir: Path, config: str | Path | None = None) -> Config:
    """The run's config: `config` when given, else the one the checkpoint carries, else (a checkpoint from
    before they carried it) the one observe/records.py wrote into the run directory holding checkpoints/."""
    candidates = [Path(config)] if config else [step_dir / CONFIG_FILE]
    if not config and step_dir.parent.name == "checkpoints":
        candidates.append(step_dir.parent.parent / CONFIG_FILE)
    file = next((f for f in candidates if f.is_file()), None)
    if file is None:
        raise CheckpointError(
            f"no config for {step_dir}: looked for {', '.join(map(str, candidates))}; pass --config with "
            "the config file the run was trained with"
        )
    try:
        raw = load_toml(file)
        # The saved config spells out the architecture; its init_from directory may be gone by now.
        raw.get("model", {}).pop("init_from", None)
        return build_config(raw)
    except ConfigError as err:
        raise CheckpointError(f"{file} does not load as a meshtron config: {err}") from None


def load_checkpoint_model(step_dir: Path, cfg: Config, device: str | torch.device = "cpu") -> Transformer:
    """The single-device model a checkpoint holds, in fp32 (the master weights), in eval mode."""
    return checkpoint_model(step_dir, cfg.model).to(device).eval()


def checkpoint_tokenizer(step_dir: Path, cfg: Config) -> Tokenizer | None:
    """The run's tokenizer: the one the checkpoint carries, else (an older checkpoint) the one of the
    run's prepared data when it is still there; None when unknown."""
    if (step_dir / TOKENIZER_FILE).is_file():
        return HFTokenizer(step_dir / TOKENIZER_FILE)
    path = cfg.data.sources[0].path if cfg.data.sources else cfg.data.path  # a mixture's: one tokenizer
    if path == "default":
        return None  # rebuilding the default corpus to find its tokenizer is not worth minutes here
    try:
        from meshtron.data.dataset import PreparedData

        return PreparedData.open(path).load_tokenizer()
    except DataError:
        return None


def hf_dir_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face directory (tokenizer.json, eos from tokenizer_config.json), or
    None when it has none."""
    if not (path / TOKENIZER_FILE).is_file():
        return None
    eos = None
    if (path / HF_TOKENIZER_CONFIG).is_file():
        eos = json.loads((path / HF_TOKENIZER_CONFIG).read_text()).get("eos_token")
    return HFTokenizer(path, eos_token=eos if isinstance(eos, str) else None)


def save_hf_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json that `transformers.AutoTokenizer` loads, and the eos id
    in config.json so that transformers' generate stops where meshtron's does."""
    from tokenizers import Tokenizer as _HFTok

    backend = _HFTok.from_str(tokenizer_json(tok))
    eos = backend.id_to_token(tok.eos_id)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # transformers is not a dependency: write what save_pretrained would
        backend.save(str(out / TOKENIZER_FILE))
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        (out / HF_TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    else:
        # No clean-up of spaces: decode must give back the text exactly (code corpora).
        fast = PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token=eos, clean_up_tokenization_spaces=False
        )
        fast.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = tok.eos_id  # a carried config.json's own eos_token_id wins (hf/carry.py)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export(
    checkpoint: str | Path,
    out: str | Path,
    config: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write checkpoint (a step directory or a checkpoints directory: its newest complete one) to `out` as
    a Hugging Face directory, streamed: one parameter in memory at a time, safetensors shards and an
    index past `max_shard_bytes`; returns a line saying what was written."""
    step_dir = resolve_checkpoint(checkpoint)
    cfg = checkpoint_config(step_dir, config)
    check_format(step_dir)
    with torch.device("meta"):
        model = Transformer(cfg.model)
        shapes = stored_shapes(model)  # (DeepSeek's router bias too: learned state, not a parameter)
        n_params = sum(p.numel() for p in model.parameters())
    out = Path(out)
    try:  # one parameter at a time: the checkpoint is read, converted and written tensor by tensor
        save_streamed_model(
            cfg.model,
            lambda name: read_model_tensor(step_dir, name, shapes[name]),
            out,
            dtype,
            max_shard_bytes,
        )
    except (ValueError, FileExistsError) as err:
        raise CheckpointError(f"cannot export {step_dir}: {err}") from None
    tok = checkpoint_tokenizer(step_dir, cfg)
    if tok is not None:
        save_hf_tokenizer(tok, out)
    carried = step_dir / CARRIED_FILE
    kept = write_carried(
        json.loads(carried.read_text()) if carried.is_file() else {}, out, cfg.training.seq_len
    )
    config = json.loads((out / "config.json").read_text())
    return (
        f"wrote {out}: {config['model_type']}, {n_params:,} parameters "
        f"({str(dtype).removeprefix('torch.')}), max_position_embeddings {config['max_position_embeddings']}, "
        f"from {step_dir}; tokenizer: {'yes' if tok is not None else 'unknown, none written'}"
        + (f"; carried from what the run was given: {', '.join(kept)}" if kept else "")
    )


def model_for_generation(
    checkpoint: str | Path | None, hf_dir: str | Path | None, config: str | Path | None, device: str
) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer `meshtron generate` decodes with: from a training checkpoint (any of the
    forms `resolve_checkpoint` takes) or a Hugging Face directory, on `device` (auto: cuda if visible)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if hf_dir is not None:
        try:
            model, tok = hf.load(hf_dir), hf_dir_tokenizer(Path(hf_dir))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot load {hf_dir}: {err}") from None
        where = str(hf_dir)
    else:
        step_dir = resolve_checkpoint(checkpoint)
        cfg = checkpoint_config(step_dir, config)
        model, tok, where = (
            load_checkpoint_model(step_dir, cfg),
            checkpoint_tokenizer(step_dir, cfg),
            str(step_dir),
        )
    if tok is None:
        raise CheckpointError(f"{where} carries no tokenizer.json, so a text prompt cannot be encoded")
    return model.to(device), tok


def cmd_export(args: argparse.Namespace) -> int:
    max_bytes = int(args.max_shard_gb * 10**9)
    print(export(args.checkpoint, args.out, args.config, getattr(torch, args.dtype), max_bytes))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from meshtron.models.generate import complete

    if args.max_new_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(["--max-new-tokens and --temperature must be >= 0, --top-p in (0, 1]"])
    model, tok = model_for_generation(args.checkpoint, args.hf, args.config, args.device)
    text = complete(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    print(args.prompt + text)
    print(cache_line(model.cfg, next(model.parameters()).dtype), file=sys.stderr)
    return 0


def cache_line(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """What decoding kept per token: the latents of multi-head latent attention, or every key/value head's
    keys and values (models/llama.py KVCache)."""
    from meshtron.models.attention import LayerKV
    from meshtron.models.latent_attention import LatentKV

    if cfg.is_mla:
        per_layer, what = (
            LatentKV.bytes_per_token(cfg, dtype),
            f"latent {cfg.kv_lora_rank} + rotary key {cfg.qk_rope_head_dim}",
        )
    else:
        per_layer, what = (
            LayerKV.bytes_per_token(cfg, dtype),
            f"keys and values of {cfg.kv_heads} heads of {cfg.head_size}",
        )
    return f"meshtron: decoding cache {per_layer * cfg.n_layers:,} bytes per token ({what} per layer, {cfg.n_layers} layers)"
