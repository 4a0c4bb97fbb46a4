"""Pictures and tables of context parallel's work split, from the same index maps the run uses.

The causal attention matrix of one sequence cut into 2·R chunks (R ring ranks): chunk-pair (a, b) with
b <= a is work; it is done by the rank holding query chunk a, at the ring step when key chunk b's
owner's K/V is there. With the zigzag assignment every rank has the same number of cells (a diagonal
cell is half a cell); with contiguous chunks the last rank has 2·R−1 times the first's.
"""

from __future__ import annotations

from pathlib import Path

from meshtron.parallel.context import ring_block, zigzag_positions
from meshtron.pictures.figures import pyplot, save_figure


def chunk_owners(ring: int, zigzag: bool = True) -> list[int]:
    """The ring rank holding each of the 2·ring chunks."""
    owners = [0] * (2 * ring)
    for r in range(ring):
        held = zigzag_positions(r, ring, 2 * ring).tolist() if zigzag else [2 * r, 2 * r + 1]
        for chunk in held:
            owners[chunk] = r
    return owners


def ring_work(ring: int, zigzag: bool = True) -> list[float]:
    """Attention work per rank in chunk-pair cells (a diagonal cell counts one half)."""
    owners, work = chunk_owners(ring, zigzag), [0.0] * ring
    for a in range(2 * ring):
        for b in range(a + 1):
            work[owners[a]] += 0.5 if a == b else 1.0
    return work


def ring_steps_table(ring: int) -> str:
    """Per ring step and rank: whose K/V it holds and which of the three block shapes it computes."""
    names = {
        "diagonal": "diagonal (causal)",
        "first_keys": "all q x first half kv",
        "last_queries": "second half q x all kv",
    }
    lines = [f"ring of {ring}: rank r holds chunks r and {2 * ring - 1}-r of {2 * ring}"]
    for i in range(ring):
        cells = []
        for r in range(ring):
            j = (r - i) % ring
            _, keys = ring_block(r, j, 2)
            shape = "diagonal" if j == r else ("first_keys" if keys.stop == 1 else "last_queries")
            cells.append(f"r{r}<-kv{j}: {names[shape]}")
        lines.append(f"step {i}: " + "; ".join(cells))
    return "\n".join(lines)


def draw_assignment(ring: int, out_path: str | Path) -> Path:
    """Two panels, zigzag and contiguous: the chunk-level causal matrix coloured by the rank that
    computes each cell, labelled with the ring step that computes it; the work per rank in the title."""
    plt = pyplot()
    from matplotlib.patches import Polygon, Rectangle

    n = 2 * ring
    fig, axes = plt.subplots(1, 2, figsize=(2 * (0.5 * n + 1.5), 0.5 * n + 1.6), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, zigzag in zip(axes[0], (True, False), strict=True):
        owners = chunk_owners(ring, zigzag)
        for a in range(n):
            for b in range(a + 1):
                colour = cmap(owners[a] % 10)
                step = (owners[a] - owners[b]) % ring
                if a == b:
                    ax.add_patch(Polygon([(b, a), (b, a + 1), (b + 1, a + 1)], color=colour))
                else:
                    ax.add_patch(Rectangle((b, a), 1, 1, color=colour))
                ax.text(
                    b + 0.5, a + 0.5 + (0.2 if a == b else 0), str(step), ha="center", va="center", fontsize=7
                )
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(n)], [f"k{c}" for c in range(n)], fontsize=7)
        ax.set_yticks([c + 0.5 for c in range(n)], [f"q{c}\nr{owners[c]}" for c in range(n)], fontsize=7)
        work = ring_work(ring, zigzag)
        label = "zigzag (load-balanced)" if zigzag else "contiguous"
        ax.set_title(f"{label}: work per rank {', '.join(f'{w:g}' for w in work)}", fontsize=8)
    fig.suptitle(
        f"causal attention over {n} chunks, ring of {ring}: colour = rank, number = ring step", fontsize=9
    )
    return save_figure(fig, out_path)
