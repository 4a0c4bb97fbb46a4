"""Pictures and tables of per-document attention over a ring, from the same functions the run uses.

A window packed with documents of the given lengths: the token-level mask (query i sees key j when
j <= i in the same document), coloured by the ring rank that computes each pair, and the chunk-level
view of the ring: each (query chunk, key chunk) cell is computed at one ring step (the number), or
skipped with its whole ring step when no query of the step shares a document with its keys
(`context.ring_step`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.parallel.context import ring_step
from meshtron.pictures.context import chunk_owners
from meshtron.pictures.figures import pyplot, save_figure


def documents_of(lengths: list[int], ring: int) -> torch.Tensor:
    """Document ids [1, S] of a window holding documents of these lengths, in order, cut for `ring`."""
    S = sum(lengths)
    if ring < 1 or min(lengths, default=0) < 1 or S % (2 * ring):
        raise ValueError(
            f"documents of {lengths} tokens ({S} in all) over a ring of {ring}: give positive lengths "
            f"whose total is a multiple of 2·ring = {2 * ring}"
        )
    return torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]


def skipped_steps(docs_BS: torch.Tensor, ring: int) -> list[list[bool]]:
    """[rank][ring step]: whether that rank skips the step (nothing of it is visible)."""
    local = docs_BS.shape[1] // ring
    return [
        [ring_step(r, (r - i) % ring, ring, local, docs_BS) is None for i in range(ring)] for r in range(ring)
    ]


def ring_documents_table(lengths: list[int], ring: int) -> str:
    """Per rank: which ring steps it computes and which it skips, and the total skipped."""
    skipped = skipped_steps(documents_of(lengths, ring), ring)
    lines = [f"documents of {', '.join(map(str, lengths))} tokens over a ring of {ring}:"]
    for r, steps in enumerate(skipped):
        marks = [
            f"step {i} (kv{(r - i) % ring}) {'skipped' if s else 'computed'}" for i, s in enumerate(steps)
        ]
        lines.append(f"rank {r}: " + "; ".join(marks))
    total = sum(map(sum, skipped))
    lines.append(f"ring steps skipped: {total} of {ring * ring}")
    return "\n".join(lines)


def _token_panel(ax, docs_S: torch.Tensor, ring: int) -> None:
    """The token-level mask, each visible pair coloured by the rank holding its query."""
    plt, S = pyplot(), docs_S.numel()
    owner = torch.tensor(chunk_owners(ring)).repeat_interleave(S // (2 * ring))
    i = torch.arange(S)
    visible = (i[:, None] >= i[None, :]) & (docs_S[:, None] == docs_S[None, :])
    image = torch.where(visible, owner[:, None].expand(S, S) + 1, torch.zeros(S, S, dtype=torch.long))
    colours = ["white", *(plt.get_cmap("tab10")(r % 10) for r in range(ring))]
    from matplotlib.colors import ListedColormap

    ax.imshow(image.numpy(), cmap=ListedColormap(colours), vmin=0, vmax=ring, interpolation="nearest")
    for edge in range(0, S + 1, S // (2 * ring)):
        ax.axhline(edge - 0.5, color="0.6", lw=0.5)
        ax.axvline(edge - 0.5, color="0.6", lw=0.5)
    ax.set_title("token mask: colour = rank holding the query", fontsize=8)
    ax.set_xlabel("key position", fontsize=7)
    ax.set_ylabel("query position", fontsize=7)
    ax.tick_params(labelsize=6)


def _chunk_panel(ax, docs_BS: torch.Tensor, ring: int) -> int:
    """Chunk cells by ring step, hatched where the step is skipped; returns the skipped steps."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    n, owners, skipped = 2 * ring, chunk_owners(ring), skipped_steps(docs_BS, ring)
    for a in range(n):
        for b in range(a + 1):
            r, j = owners[a], owners[b]
            step = (r - j) % ring
            if skipped[r][step]:
                ax.add_patch(Rectangle((b, a), 1, 1, facecolor="0.92", edgecolor="0.5", hatch="xx", lw=0.3))
                continue
            ax.add_patch(Rectangle((b, a), 1, 1, color=plt.get_cmap("tab10")(r % 10)))
            ax.text(b + 0.5, a + 0.5, str(step), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(n)], [f"k{c}" for c in range(n)], fontsize=7)
    ax.set_yticks([c + 0.5 for c in range(n)], [f"q{c}\nr{owners[c]}" for c in range(n)], fontsize=7)
    total = sum(map(sum, skipped))
    ax.set_title(f"ring steps: number = step, hatched = skipped ({total} of {ring * ring})", fontsize=8)
    return total


def draw_documents(lengths: list[int], ring: int, out_path: str | Path) -> Path:
    """The token mask and the ring's chunk cells side by side for documents of `lengths` tokens."""
    plt, docs = pyplot(), documents_of(lengths, ring)
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.8))
    _token_panel(axes[0], docs[0], ring)
    _chunk_panel(axes[1], docs, ring)
    names = ", ".join(map(str, lengths))
    fig.suptitle(f"per-document attention, documents of {names} tokens, ring of {ring}", fontsize=9)
    return save_figure(fig, out_path)
