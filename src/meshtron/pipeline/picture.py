"""Draw a pipeline timeline: ranks as rows, forward / backward / weight-gradient blocks with micro-batch
numbers. The same function draws a simulated schedule and (later) a measured one."""

from __future__ import annotations

from pathlib import Path

from meshtron.pipeline.schedules import Action

COLOURS = {"F": "#4c8bd6", "B": "#e0793a", "W": "#58a55c"}


def draw_timeline(
    timeline: list[list[tuple[Action, float, float]]], out_path: str | Path, title: str, vpp: int = 1
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(timeline)
    makespan = max((end for rank in timeline for _, _, end in rank), default=1.0)
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, makespan * 0.35)), 0.55 * pp + 1.3))
    for r, rank in enumerate(timeline):
        for action, start, end in rank:
            # Later virtual chunks are drawn lighter, so interleaving is visible.
            shade = 1.0 - 0.45 * (action.chunk // pp) / max(1, vpp - 1) if vpp > 1 else 1.0
            ax.barh(
                r,
                end - start,
                left=start,
                height=0.8,
                color=COLOURS[action.kind],
                alpha=shade,
                edgecolor="white",
                linewidth=0.6,
            )
            if end - start >= 0.3:
                ax.text(
                    (start + end) / 2, r, str(action.mb), ha="center", va="center", fontsize=7, color="white"
                )
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of one forward of a stage)")
    ax.set_xlim(0, makespan)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(
        handles,
        [
            "forward",
            "backward (input grad)"
            if any(a.kind == "W" for rk in timeline for a, _, _ in rk)
            else "backward",
            "weight grad",
        ],
        loc="upper right",
        fontsize=7,
        ncol=3,
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
