"""Draw pipeline timelines: ranks as rows, forward / backward / weight-gradient blocks with micro-batch
numbers. The same code draws a simulated schedule and one measured in a training run, stacked in panels
over a shared time axis so the two can be compared."""

from __future__ import annotations

from pathlib import Path

from meshtron.config import PipelineSchedule
from meshtron.figures import pyplot, save_figure
from meshtron.pipeline.schedules import Action, Kind, build_schedule, idle_fraction, simulate

COLOURS = {Kind.F: "#4c8bd6", Kind.B: "#e0793a", Kind.W: "#58a55c"}
Timeline = list[list[tuple[Action, float, float]]]


def draw_timeline(timeline: Timeline, out_path: str | Path, title: str, vpp: int = 1) -> Path:
    """One schedule, in units of one stage's forward."""
    return draw_timelines([(timeline, title)], out_path, vpp, "time (units of one forward of a stage)")


def draw_timelines(panels: list[tuple[Timeline, str]], out_path: str | Path, vpp: int, xlabel: str) -> Path:
    plt = pyplot()

    pp = len(panels[0][0])
    makespan = max((end for timeline, _ in panels for rank in timeline for _, _, end in rank), default=1.0)
    mean_block = sum(end - start for _, start, end in panels[0][0][0]) / max(1, len(panels[0][0][0]))
    width = max(6.0, min(24.0, 0.35 * makespan / max(mean_block, 1e-12)))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(width, len(panels) * (0.55 * pp + 1.0) + 0.5), sharex=True, squeeze=False
    )
    split = any(a.kind == Kind.W for timeline, _ in panels for rank in timeline for a, _, _ in rank)
    for ax, (timeline, title) in zip(axes[:, 0], panels, strict=True):
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
                if end - start >= 0.3 * mean_block:
                    ax.text(
                        (start + end) / 2,
                        r,
                        str(action.mb),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel(xlabel)
    axes[-1, 0].set_xlim(0, makespan)
    labels = {
        Kind.F: "forward",
        Kind.B: "backward (input grad)" if split else "backward",
        Kind.W: "weight grad",
    }
    kinds = [Kind.F, Kind.B, Kind.W] if split else [Kind.F, Kind.B]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds]
    axes[0, 0].legend(handles, [labels[k] for k in kinds], loc="upper right", fontsize=7, ncol=3)
    return save_figure(fig, out_path)


def draw_measured_timeline(
    measured: Timeline, schedule: PipelineSchedule, vpp: int, microbatches: int, out_path: str | Path
) -> tuple[Path, float, float]:
    """A training step's real timeline (seconds from each rank's step start) above the simulation of the
    same schedule with that step's mean time of each kind of action on each chunk: the simulation has
    the same compute, stage imbalance included, and free communication, so what differs is the
    communication and the waiting on it. Returns (picture, measured bubble, simulated bubble)."""
    ms = [[(a, 1e3 * start, 1e3 * end) for a, start, end in rank] for rank in measured]
    durations: dict[tuple[Kind, int], list[float]] = {}
    for rank in ms:
        for a, start, end in rank:
            durations.setdefault((a.kind, a.chunk), []).append(end - start)
    mean = {key: sum(d) / len(d) for key, d in durations.items()}
    sim = simulate(build_schedule(len(ms), vpp, microbatches, schedule), vpp=vpp, chunk_costs=mean)
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
    return draw_timelines(panels, out_path, vpp, "time in the step (ms)"), bubble, sim.bubble_fraction
