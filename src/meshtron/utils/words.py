"""Words for messages: counts ("1 file", "2 files") and the nearest known name ("did you mean ...?")."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def plural(n: int, word: str) -> str:
    """`n` and `word`, plural unless n is 1: "1 file", "2 files", "1,024 ranks"."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def suggest(name: str, options: Sequence[str], list_known: bool = True) -> str:
    """'; did you mean X?' for the option closest to `name`, else the known options (or nothing)."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(options)})" if list_known else ""
