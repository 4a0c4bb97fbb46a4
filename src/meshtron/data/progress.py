"""Progress of tokenizing a corpus: one line rewritten in place when someone watches a terminal, nothing
when the output goes to a log (where a line per update would bury everything else; the caller prints one
summary line at the end instead)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stand-in stream without isatty, or a closed one
        return False


class Progress:
    """Files done of the total, tokens written and tokens/s, shown at most every `every_s` seconds."""

    def __init__(
        self,
        total_files: int,
        live: bool | None = None,
        stream: TextIO | None = None,
        every_s: float = 0.25,
    ):
        """`live`: show progress (None: when `stream`, by default stderr, is a terminal)."""
        self.stream = stream if stream is not None else sys.stderr
        self.live = is_terminal(self.stream) if live is None else live
        self.total_files, self.files, self.tokens = total_files, 0, 0
        self.every_s = every_s
        self.start: float | None = None  # at the first count, so a BPE trained before does not slow the rate
        self._shown_at = float("-inf")
        self._width = 0  # of the line on screen, padded over when a shorter one replaces it

    def note(self, text: str) -> None:
        """A phase without a count (e.g. training a BPE), on its own line."""
        if self.live:
            self.stream.write(text + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.perf_counter() - (self.start or time.perf_counter()), 1e-9)
        return (
            f"tokenizing: {self.files}/{self.total_files} files, {self.tokens:,} tokens, "
            f"{self.tokens / elapsed:,.0f} tokens/s"
        )

    def update(self, files_done: int, tokens: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        self.files, self.tokens = files_done, tokens
        if self.live and time.perf_counter() - self._shown_at >= self.every_s:
            self._show()

    def _show(self) -> None:
        text = self.line()
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)
        self._shown_at = time.perf_counter()

    def close(self) -> None:
        """The final counts, and the line ended so that what follows starts on a line of its own."""
        if self.live:
            self._show()
            self.stream.write("\n")
            self.stream.flush()
