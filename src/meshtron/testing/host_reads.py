"""Count where meshtron reads device values on the host during a training step.

On a GPU each such read waits for the device to finish everything queued before it (a host
synchronisation), so the hot path should have as few as possible (docs/performance.md lists them). On
a CPU nothing waits, but the calls are the same: while `counting()` is active, every Tensor method that
copies a value to the host (`item`, `tolist`, `cpu`, `numpy`, `bool()`, `float()`, `int()`, `index`)
and every operator whose output size depends on the data (`nonzero`, `bincount`, `repeat_interleave`
with tensor repeats and no output_size, `unique`, `masked_select`) is counted when meshtron's own code calls it, by
calling function ("models.moe:sort_by_expert nonzero").
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator

import torch

# Copies to the host, as Tensor methods.
METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# Operators whose output size depends on the data, as torch functions and Tensor methods.
SIZED = ("nonzero", "bincount", "repeat_interleave", "unique", "masked_select")


def _caller() -> str | None:
    """`module:function` of the caller of the patched call when it is meshtron's code (not its
    testing helpers), else None."""
    frame = sys._getframe(2)  # 0: here, 1: the patched call, 2: its caller
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("meshtron.") or module.startswith("meshtron.testing"):
        return None
    return f"{module.removeprefix('meshtron.')}:{frame.f_code.co_name}"


def _counted(counts: Counter, name: str, original):
    def call(*args, **kwargs):
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        sized = isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if name != "repeat_interleave" or sized:  # int repeats, or the size given, need no read
            where = _caller()
            if where is not None:
                counts[f"{where} {name.strip('_')}"] += 1
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Within the block, count meshtron's host reads (see the module docstring) into the Counter."""
    counts: Counter = Counter()
    targets = [(torch.Tensor, name) for name in (*METHODS, *SIZED)] + [(torch, name) for name in SIZED]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, original in saved:
        setattr(owner, name, _counted(counts, name, original))
    try:
        yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def step_host_reads(overrides: list[str], warmup: int = 2) -> dict[str, int]:
    """On every rank: meshtron's host reads during one training step, after `warmup` steps."""
    from meshtron.testing.parity import trainer_for

    trainer = trainer_for(overrides)
    for step in range(warmup):
        trainer.step(step)
    with counting() as counts:
        trainer.step(warmup)
    return dict(counts)
