"""Hugging Face checkpoint interop: `load` a transformers checkpoint directory, `save` one."""

from meshtron.models.hf import load, save
from meshtron.models.hf_config import config_from_hf, config_to_hf

__all__ = ["config_from_hf", "config_to_hf", "load", "save"]
