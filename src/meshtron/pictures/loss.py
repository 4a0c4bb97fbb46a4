"""A run's loss curve (loss.png): training loss per step, validation loss at each evaluation."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from meshtron.pictures.figures import pyplot, save_figure


def plot_loss(
    rows: list[dict[str, Any]], out_path: Path, title: str, val_rows: list[dict[str, Any]] = ()
) -> Path:
    """The training loss per step, and the validation loss at each evaluation when there are any."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], linewidth=1.5, label="training")
    if val_rows:
        steps, losses = [r["step"] for r in val_rows], [r["val_loss"] for r in val_rows]
        ax.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, label="validation")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 on a short run
    ax.set_title(textwrap.fill(title, 80), fontsize=9)  # a long mesh summary wraps, not cut at the edges
    ax.grid(alpha=0.3)
    return save_figure(fig, out_path)
