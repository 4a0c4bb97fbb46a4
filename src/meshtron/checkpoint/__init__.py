"""Distributed checkpoints: each rank saves what it holds, any layout loads it, a crash never corrupts
the last good one. The error a checkpoint reports to its user is defined here, free of torch.

save_load.py      save (write to a temporary folder, publish by rename) and load on any layout
blocks.py         the blocks a rank writes: its rectangles of the logical tensors
async_save.py     saving in a background thread while training goes on
integrity.py      checksums written beside the data and checked on load
safe_reader.py    reading a checkpoint without unpickling code
saved_regions.py  reading a box of a saved tensor without reading the rest
"""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this model; the message says what to do."""
