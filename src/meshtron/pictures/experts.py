"""Expert load over a run (expert-load.png): one heat map per MoE layer, experts over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meshtron.pictures.figures import pyplot, save_figure


def _model_order(name: str) -> tuple[bool, int]:
    """ "layers.<i>" by i, then the multi-token prediction modules' "mtp.<depth>.block" by depth."""
    return name.startswith("mtp."), int(name.split(".")[1])


def draw_expert_load(rows: list[dict[str, Any]], out_path: Path, title: str) -> Path | None:
    """One heat map per MoE layer: experts (rows) over steps (columns), each expert's load relative to the
    layer's mean that step (1 = balanced). None when the rows hold no MoE metrics."""
    rows = [r for r in rows if "moe" in r]
    if not rows:
        return None
    layers = sorted(rows[0]["moe"], key=_model_order)
    plt = pyplot()
    cols = min(len(layers), 4)
    n_rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(n_rows, cols, squeeze=False, figsize=(3.2 * cols + 1, 2.6 * n_rows + 0.6))
    steps = [r["step"] for r in rows]
    for ax, name in zip(axes.flat, layers, strict=False):
        load = np.array([r["moe"][name]["load"] for r in rows], dtype=float).T  # [E, steps]
        relative = load / np.maximum(load.mean(axis=0, keepdims=True), 1e-9)
        image = ax.imshow(
            relative,
            aspect="auto",
            cmap="coolwarm",
            vmin=0,
            vmax=2,
            interpolation="nearest",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, load.shape[0] - 0.5, -0.5),
        )
        ax.set_title(f"{name}: worst {max(r['moe'][name]['imbalance'] for r in rows):.2f}x mean", fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02).set_label("load / mean", fontsize=7)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, out_path)
