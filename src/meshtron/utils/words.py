"""Counts in words, for messages: "1 file", "2 files"."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """`n` and `word`, plural unless n is 1: "1 file", "2 files", "1,024 ranks"."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
