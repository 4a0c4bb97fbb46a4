"""Draw pipeline timelines: ranks as rows, forward / backward / weight-gradient blocks with micro-batch
numbers. The same code draws a simulated schedule and one measured in a training run, stacked in panels
over a shared time axis so the two can be compared. Actions that ran at once on a rank (a DualPipeV
pair's forward and backward) share its row, the forward on top; a measured panel may also carry the
rank's communication waits, drawn as thin bars on the half of the thread that waited (all-to-alls dark)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from meshtron.config.schema import PipelineSchedule
from meshtron.pictures.figures import pyplot, save_figure
from meshtron.schedules.actions import Action, Kind
from meshtron.schedules.build import build_schedule, idle_fraction, simulate

COLOURS = {Kind.F: "#4c8bd6", Kind.B: "#e0793a", Kind.W: "#58a55c"}
WAIT_COLOURS = {"all_to_all": "#222222", "other": "#a0a0a0"}
Timeline = list[list[tuple[Action, float, float]]]
Waits = list[list[tuple[str, str, str, float, float]]]  # per rank: (op, group, lane, start, end)


def _rows(rank: list[tuple[Action, float, float]]) -> list[tuple[float, float]]:
    """Per action, (y offset, height) in its rank's row: the full row, or a half when another action
    of the rank ran at the same time (the forward's thread on top)."""
    rows = []
    for i, (a, start, end) in enumerate(rank):
        shared = any(min(end, e) - max(start, s) > 0 for j, (_, s, e) in enumerate(rank) if j != i)
        rows.append(((-0.2 if a.kind == Kind.F else 0.2), 0.4) if shared else (0.0, 0.8))
    return rows


def _draw_waits(ax: Any, r: int, waits: list[tuple[str, str, str, float, float]]) -> None:
    for op, _, lane, start, end in waits:
        colour = WAIT_COLOURS["all_to_all" if op == "all_to_all" else "other"]
        ax.barh(r + (-0.36 if lane == "pair" else 0.36), end - start, left=start, height=0.08, color=colour)


def draw_timeline(timeline: Timeline, out_path: str | Path, title: str, vpp: int = 1) -> Path:
    """One schedule, in units of one stage's forward."""
    return draw_timelines([(timeline, title)], out_path, vpp, "time (units of one forward of a stage)")


def draw_timelines(
    panels: list[tuple[Timeline, str]],
    out_path: str | Path,
    vpp: int,
    xlabel: str,
    waits: Waits | None = None,
) -> Path:
    """`waits`: the first panel's ranks' communication waits, drawn on it."""
    plt = pyplot()

    pp = len(panels[0][0])
    ends = [end for timeline, _ in panels for rank in timeline for _, _, end in rank]
    ends += [w[4] for rank in waits or [] for w in rank]  # a wait can outlast the rank's last action
    makespan = max(ends, default=1.0)
    mean_block = sum(end - start for _, start, end in panels[0][0][0]) / max(1, len(panels[0][0][0]))
    width = max(6.0, min(24.0, 0.35 * makespan / max(mean_block, 1e-12)))
    # Titles wrap to the figure's width (a 9-point character is about 0.075 inch), not cut at its edges.
    titles = [textwrap.fill(title, int(width / 0.075)) for _, title in panels]
    extra = sum(0.16 * title.count("\n") for title in titles)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, len(panels) * (0.55 * pp + 1.0) + 0.5 + extra),
        sharex=True,
        squeeze=False,
    )
    split = any(a.kind == Kind.W for timeline, _ in panels for rank in timeline for a, _, _ in rank)
    # A bar carries its micro-batch number where the number fits (about a fifth of an inch).
    label_width = max(0.3 * mean_block, 0.2 * makespan / (0.8 * width))
    for p, (ax, (timeline, _), title) in enumerate(zip(axes[:, 0], panels, titles, strict=True)):
        for r, rank in enumerate(timeline):
            if waits is not None and p == 0:
                _draw_waits(ax, r, waits[r])
            for (action, start, end), (offset, height) in zip(rank, _rows(rank), strict=True):
                shade = _shade(action.chunk, pp, vpp)
                ax.barh(
                    r + offset,
                    end - start,
                    left=start,
                    height=height,
                    color=COLOURS[action.kind],
                    alpha=shade,
                    edgecolor="white",
                    linewidth=0.6,
                )
                if end - start >= label_width:
                    ax.text(
                        (start + end) / 2,
                        r + offset,
                        str(action.mb),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
        ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top, no margin rows (64 ranks kept 3 empty at each end)
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel(xlabel)
    axes[-1, 0].set_xlim(0, 1.01 * makespan)  # the last action's right edge inside the frame
    _legend(plt, fig, axes[-1, 0], split, waits is not None, pp, vpp)
    return save_figure(fig, out_path)


def _legend(plt: Any, fig: Any, ax: Any, split: bool, waits: bool, pp: int, vpp: int) -> None:
    """The kinds of action (and of wait, and the virtual chunks' shades), below the last panel's axis."""
    labels = {
        Kind.F: "forward",
        Kind.B: "backward (input grad)" if split else "backward",
        Kind.W: "weight grad",
    }
    kinds = [Kind.F, Kind.B, Kind.W] if split else [Kind.F, Kind.B]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds]
    names = [labels[k] for k in kinds]
    if waits:
        handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in WAIT_COLOURS.values()]
        names += ["all-to-all wait", "other communication wait"]
    if vpp > 1:  # the shades: which virtual chunks an action belongs to (the model's layers in order)
        handles += [
            plt.Rectangle((0, 0), 1, 1, color="0.35", alpha=_shade(v * pp, pp, vpp)) for v in range(vpp)
        ]
        names += [f"chunks {v * pp}-{(v + 1) * pp - 1}" for v in range(vpp)]
    # Below the bars, under the time axis (inside the axes it covered rank 0's last actions), half an
    # inch down whatever the figure's height.
    below = 0.55 / (ax.get_position().height * fig.get_figheight())
    where = {"loc": "upper center", "bbox_to_anchor": (0.5, -below)}
    ax.legend(handles, names, **where, fontsize=7, ncol=len(names), frameon=False)


def _shade(chunk: int, pp: int, vpp: int) -> float:
    """Later virtual chunks are drawn lighter, so interleaving and the V's two passes are visible."""
    return 1.0 - 0.45 * (chunk // pp) / max(1, vpp - 1) if vpp > 1 else 1.0


def draw_measured_timeline(
    measured: Timeline,
    schedule: PipelineSchedule,
    vpp: int,
    microbatches: int,
    out_path: str | Path,
    waits: Waits | None = None,
    paired: bool = False,
) -> tuple[Path, float, float]:
    """A training step's real timeline (seconds from each rank's step start), with its communication
    waits when given, above the simulation of the same schedule (`paired`: its F&B pairs as units) with
    that step's mean time of each kind of action on each chunk: the simulation has the same compute,
    stage imbalance included, free communication and no overlap, so what differs is the communication,
    the waiting on it, and what overlap hid. Returns (picture, measured bubble, simulated bubble)."""
    ms = [[(a, 1e3 * start, 1e3 * end) for a, start, end in rank] for rank in measured]
    waits_ms = None if waits is None else [[(*w[:3], 1e3 * w[3], 1e3 * w[4]) for w in rank] for rank in waits]
    durations: dict[tuple[Kind, int], list[float]] = {}
    for rank in ms:
        for a, start, end in rank:
            durations.setdefault((a.kind, a.chunk), []).append(end - start)
    mean = {key: sum(d) / len(d) for key, d in durations.items()}
    sim = simulate(build_schedule(len(ms), vpp, microbatches, schedule, paired), vpp=vpp, chunk_costs=mean)
    bubble = idle_fraction(ms)
    where = f"{schedule}, pp={len(ms)}, vpp={vpp}, {microbatches} micro-batches"
    panels = [
        (ms, f"measured ({where}): bubble {100 * bubble:.1f}%"),
        (
            sim.timeline,
            f"simulated (measured mean time per action kind and chunk, free communication): "
            f"bubble {100 * sim.bubble_fraction:.1f}%",
        ),
    ]
    picture = draw_timelines(panels, out_path, vpp, "time in the step (ms)", waits_ms)
    return picture, bubble, sim.bubble_fraction
