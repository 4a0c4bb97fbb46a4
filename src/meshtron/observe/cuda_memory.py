"""The CUDA caching allocator's history of a profiled window, as a snapshot per rank.

`torch.cuda.memory._record_memory_history` and `_dump_snapshot` are private names (a torch release may
change them without notice): PyTorch has no public API that records every allocation with its stack.
They are used here alone, and listed in tests/test_architecture.py. The snapshot opens in
pytorch.org/memory_viz (a timeline of every live block, with the Python stack that allocated it).
"""

from __future__ import annotations

from pathlib import Path

import torch

MAX_ENTRIES = 200_000  # allocation events kept: a few steps of a large model


def start_history() -> None:
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def dump_history(path: Path) -> None:
    """Write the recorded history to `path` and stop recording."""
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
