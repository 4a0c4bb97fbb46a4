"""Where meshtron keeps what it prepares or measures once per machine: the tokenized default corpus, the
hardware probe's and the MFU reference's measurements.

`$MESHTRON_CACHE` when set, else `$XDG_CACHE_HOME/meshtron` (the XDG base-directory convention), else
`~/.cache/meshtron`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("MESHTRON_CACHE"):
        return Path(os.environ["MESHTRON_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshtron"
