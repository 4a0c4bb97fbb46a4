"""Whether this thread is rerunning a forward for its backward (activation recompute).

Set by parallel/recompute.py around every recomputation; read where a rerun must not repeat what the
forward did: ZeRO-3's prefetch of the next unit (already reduced in this backward: a gather thrown
away) and its resharding after the unit's forward (its backward follows at once). Per thread, as
torch's grad mode is: a DualPipeV pair may recompute in one thread while the other runs a forward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Rerun(threading.local):
    on = False


_RERUN = _Rerun()


@contextlib.contextmanager
def rerunning() -> Iterator[None]:
    before, _RERUN.on = _RERUN.on, True
    try:
        yield
    finally:
        _RERUN.on = before


def is_rerunning() -> bool:
    return _RERUN.on
