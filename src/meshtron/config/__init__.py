"""Configuration, torch-free: what a run is, before anything checks whether it can run.

schema.py       the config dataclasses (every TOML section and key), their ranges and options
loading.py      a Config from TOML files and `--section.key=value` overrides, presets applied
presets.py      named architectures (llama3-*, mixtral-8x7b, deepseek-v3, deepseek-style-moe, tiny-*)
layout.py       ParallelDims: a layout's degrees, its axes and the rank groups they imply
huggingface.py  a Hugging Face config.json <-> ModelConfig
deepseek.py     ...DeepSeek-V3's
init_from.py    `model.init_from = DIR`: the run's [model] keys from the checkpoint's config.json
optimizer.py    which parameters each optimizer trains (Muon: the blocks' matrices)
"""
