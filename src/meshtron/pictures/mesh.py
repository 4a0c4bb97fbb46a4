"""The device mesh as a picture (`meshtron mesh`): one panel per parallel dim, ranks as nodes x GPUs,
coloured by their group in that dim."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtron.config.layout import ParallelDims
from meshtron.pictures.figures import pyplot, save_figure


def draw_mesh(dims: ParallelDims, gpus_per_node: int, out_path: str | Path) -> Path:
    """PNG with one panel per dim of size > 1: ranks laid out as nodes (rows) x GPUs (columns),
    each coloured by its group in that dim; thick lines mark node boundaries."""
    plt = pyplot()

    # The attention's grid, then the experts' (MoE parallel folding: their own groups over the same ranks).
    dense = [d for d in ("tp", "cp", "dp_shard", "dp_replicate", "pp") if dims.size(d) > 1]
    experts = [d for d in ("ep", "edp") if dims.experts_apart and dims.size(d) > 1]
    panels = [*dense, *experts] or ["tp"]
    n_nodes = -(-dims.world_size // gpus_per_node)
    crossing = set(dims.crossing_dims(gpus_per_node))
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    cell = 0.45 if dims.world_size <= 256 else 0.12
    fig, axes = plt.subplots(
        rows,
        cols,
        squeeze=False,
        figsize=(max(4.0, cols * (gpus_per_node * cell + 1.2)), rows * (n_nodes * cell + 1.3)),
    )
    cmap = plt.get_cmap("tab20")
    for ax, dim in zip(axes.flat, panels, strict=False):
        owner = np.full(n_nodes * gpus_per_node, -1)
        for g_id, group in enumerate(dims.groups(dim)):
            owner[group] = g_id
        colours = np.ones((n_nodes, gpus_per_node, 3))
        for rank in range(dims.world_size):
            colours[rank // gpus_per_node, rank % gpus_per_node] = cmap(owner[rank] % 20)[:3]
        ax.imshow(colours, aspect="equal")
        if dims.world_size <= 128:
            for rank in range(dims.world_size):
                ax.text(
                    rank % gpus_per_node,
                    rank // gpus_per_node,
                    str(rank),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        for boundary in range(1, n_nodes):
            ax.axhline(boundary - 0.5, color="black", linewidth=2.5)
        where = "crosses nodes" if dim in crossing else "within nodes"
        ax.set_title(f"{dim}={dims.size(dim)}: {len(dims.groups(dim))} groups, {where}", fontsize=9)
        ax.set_xticks(range(gpus_per_node) if gpus_per_node <= 16 else [])
        ax.set_yticks(range(n_nodes) if n_nodes <= 32 else [])
        ax.set_xlabel("GPU in node", fontsize=8)
        ax.set_ylabel("node", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"meshtron {dims.summary()}", fontsize=10)
    return save_figure(fig, out_path)
