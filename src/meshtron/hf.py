"""Hugging Face checkpoint interop: `load` a transformers checkpoint directory, `save` one."""

from meshtron.models.hf import config_from_hf, config_to_hf, load, save

__all__ = ["config_from_hf", "config_to_hf", "load", "save"]
