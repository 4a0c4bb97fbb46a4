"""Whether a config can run, torch-free, checked before any process starts: one module per subject,
each returning problems as messages that say what to change, and checks.py, which loads a config and
gathers them (`load_config`, `validate`, `check`).

model.py     architecture keys, presets
data.py      data sources, batch splits (`micro_batches_per_step`)
parallel.py  degrees against the world size and the model, every parallel.* key
pipeline.py  schedules against stages, micro-batches and layers
training.py  steps, precision, recompute, checkpoints and the keys that need a parallelism
"""
