"""A bounded memo for the planner's pure functions, whose arguments (configs) are not hashable.

The search asks for the same few stages' sums thousands of times for every micro-batch size and
recompute mode it tries; each such function forms a hashable key from what decides its answer and keeps
the answer in a `Memo`. A memo forgets everything at once when it grows past its limit (the search's
working set is far smaller, so this only bounds a long-lived process such as the test suite).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    """Values computed once per key; `limit` entries at most."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.entries: dict[Hashable, tuple[object, V]] = {}

    def get(self, key: Hashable, compute: Callable[[], V], keep: object = None) -> V:
        """The value under `key`, computed by `compute()` the first time it is asked for. `keep`: an
        object whose `id` is part of the key (it is not hashable); it is kept with the value, so that
        its id cannot be reused by another object while the entry lives, and checked on every read."""
        entry = self.entries.get(key)
        if entry is None or entry[0] is not keep:
            if len(self.entries) > self.limit:
                self.entries.clear()
            entry = self.entries[key] = (keep, compute())
        return entry[1]
