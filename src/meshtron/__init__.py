"""meshtron: Llama-family training with every parallelism composed on one device mesh."""

__version__ = "0.1.0"
