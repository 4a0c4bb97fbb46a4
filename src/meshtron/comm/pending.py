"""Handles of in-flight collectives (collectives.py issues them): wait with the comm layer's deadline."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from meshtron.comm.group import CommGroup


class Pending:
    """An in-flight collective; `wait()` blocks (with the comm deadline) until its buffers are valid."""

    def __init__(
        self,
        wait: Callable[[Any, str, CommGroup], None],
        work: Any,
        op: str,
        group: CommGroup,
        on_done: Callable[[], None] | None = None,
    ):
        # `wait`: the comm's wait with its deadline (Comm.wait)
        self._wait, self.work, self.op, self.group, self.on_done = wait, work, op, group, on_done

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            self._wait(work, self.op, self.group)
            if self.on_done is not None:
                self.on_done()

    def completed(self) -> bool:
        """Whether the operation has finished (without waiting); `wait()` is still to be called."""
        return self.work is None or self.work.is_completed()


class Works:
    """Several in-flight operations waited on as one."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        return all(w.wait(timeout=timeout) is not False for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)
