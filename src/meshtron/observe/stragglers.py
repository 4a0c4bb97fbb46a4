"""The straggler report: once per log interval, which rank is slowest, by how much, and in which phase.

Every rank sends its interval's compute seconds per phase and its seconds blocked per group (comm/timing.py)
in one small all-gather; every rank then computes the same report:

  compute_r    rank r's compute seconds per step (its phases' wall time minus its waits)
  slowest      argmax_r compute_r
  median       the median of compute_r over the other ranks, and the excess compute_slowest / median - 1
  phase        the phase whose compute on the slowest rank passes the others' median the most
  waits        the mean over ranks of the seconds per step blocked in each group's collectives

A rank that computes longer makes the others wait for it in the next collective they share, so a
straggler shows twice: as the largest compute, and as the waits of everyone else on that group. The
console names it when its excess passes `profile.straggler_threshold`; every interval's metrics row
carries the figures. This follows Megatron-LM's straggler detector (per-rank compute timed and
gathered, the slowest ranks reported) with the phase and the waits per group added.
"""

from __future__ import annotations

import statistics
from typing import Any

from meshtron.comm.timing import PHASES


def straggler_report(times_by_rank: list[dict[str, dict[str, float]]], steps: int) -> dict[str, Any]:
    """The report's fields (a metrics row's) from each rank's `PhaseTimes.take()` over `steps` steps."""
    steps = max(steps, 1)
    compute = [sum(t["compute"].values()) / steps for t in times_by_rank]
    slowest = max(range(len(compute)), key=compute.__getitem__)
    others = [r for r in range(len(compute)) if r != slowest] or [slowest]
    median = statistics.median(compute[r] for r in others)

    def per_step(rank: int, phase: str) -> float:
        return times_by_rank[rank]["compute"].get(phase, 0.0) / steps

    extra = {p: per_step(slowest, p) - statistics.median(per_step(r, p) for r in others) for p in PHASES}
    phase = max(PHASES, key=extra.__getitem__)
    groups = sorted({g for t in times_by_rank for g in t["waits"]})
    waits = {g: sum(t["waits"].get(g, 0.0) for t in times_by_rank) / (steps * len(compute)) for g in groups}
    return {
        "slowest_rank": slowest,
        "slowest_compute_s": compute[slowest],
        "median_compute_s": median,
        "slowest_excess": compute[slowest] / median - 1 if median > 0 else 0.0,
        "slowest_phase": phase,
        "slowest_phase_extra_s": extra[phase],
        "comm_wait_s_by_group": waits,
    }


def straggler_line(report: dict[str, Any], threshold: float) -> str | None:
    """The console's line when the slowest rank's excess passes `threshold`, else None. `report`: the
    trainer's row fields (`straggler_report`'s, with "straggler_steps": [first, last])."""
    if report["slowest_excess"] <= threshold:
        return None
    first_step, last_step = report["straggler_steps"]
    waits = report["comm_wait_s_by_group"]
    waited = max(waits, key=waits.__getitem__) if waits else None
    tail = f"; the ranks waited most on '{waited}' ({waits[waited]:.3f} s/step)" if waited else ""
    return (
        f"meshtron: straggler in steps {first_step}-{last_step}: rank {report['slowest_rank']} computed "
        f"{report['slowest_compute_s']:.3f} s/step, {100 * report['slowest_excess']:.0f}% above the median "
        f"{report['median_compute_s']:.3f} s, most of it in {report['slowest_phase']} "
        f"(+{report['slowest_phase_extra_s']:.3f} s/step){tail}"
    )
