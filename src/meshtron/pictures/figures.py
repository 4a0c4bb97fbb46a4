"""The matplotlib plumbing every picture shares: headless pyplot, and saving a figure to a path."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); imported only when a picture is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close `fig`; returns the path written."""
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    pyplot().close(fig)
    return out_path
