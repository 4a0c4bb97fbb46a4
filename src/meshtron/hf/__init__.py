"""Hugging Face interop, in one package: `load` a transformers checkpoint directory as a meshtron model,
`save` one that transformers loads, and start a run from one in any layout (`model.init_from`).

  weights.py     weight names, strict whole-model `load` and `save`
  checkpoint.py  a checkpoint read tensor by tensor and region by region
  init_from.py   each rank reads its own slices of a checkpoint into its parallel layout
  carry.py       what an export keeps of the Hugging Face files a run was given (config fields, tokenizer)

The torch-free parts live with the configuration: config/huggingface.py (config.json <-> ModelConfig, a
checkpoint's files and tensor names) and config/init_from.py (model.init_from's [model] keys, while the
config is merged). `load` and `save` import torch when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtron.config.huggingface import config_from_hf, config_to_hf

if TYPE_CHECKING:
    from meshtron.models.llama import Transformer

__all__ = ["config_from_hf", "config_to_hf", "load", "save"]


def load(path: str | Path, dtype: Any = None) -> Transformer:
    """A meshtron Transformer from a transformers checkpoint directory (fp32 unless `dtype` says)."""
    import torch

    from meshtron.hf.weights import load_model

    return load_model(path, torch.float32 if dtype is None else dtype)


def save(model: Transformer, path: str | Path) -> None:
    """Write `model` as a directory transformers loads (config.json + model.safetensors)."""
    from meshtron.hf.weights import save_model

    save_model(model, path)
