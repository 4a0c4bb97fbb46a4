"""What `meshtron plan` prints: a ranked table, or JSON objects, and the reasons layouts were dropped."""

from __future__ import annotations

import json
from typing import Any

from meshtron.plan.estimate import Estimate
from meshtron.plan.layout import Layout
from meshtron.plan.search import Plan

GiB = 2**30
TIME_PARTS = ("compute", "tp", "cp", "ep", "pp", "pp_bubble", "dp", "optimizer")


def as_json(layout: Layout, est: Estimate, overlap: list[str]) -> dict[str, Any]:
    """One ranked layout as the documented JSON object (docs/planner.md#json); `overlap`: what the
    estimate hid behind compute (`--overlap`'s names)."""
    return {
        "layout": layout.to_dict(),
        "overlap": overlap,
        "step_time_s": est.step_time_s,
        "tokens_per_sec_per_gpu": est.tokens_per_sec_per_gpu,
        "mfu": est.mfu,
        "memory_bytes_per_gpu": est.memory_bytes_per_gpu,
        "memory_breakdown_bytes": est.memory,
        "step_breakdown_s": est.time,
        "pipeline_bubble_fraction": est.bubble_fraction,
    }


def plan_json(plan: Plan, overlap: list[str]) -> str:
    return json.dumps([as_json(layout, est, overlap) for layout, est in plan.ranked], indent=2)


def _breakdown(est: Estimate) -> str:
    step = est.step_time_s
    parts = [
        f"{name} {100 * est.time[name] / step:.0f}%"
        for name in (*TIME_PARTS, "lent_cores")  # lent_cores: negative, shared cores (estimate.py)
        if abs(est.time.get(name, 0)) > 0.005 * step
    ]
    return ", ".join(parts)


def plan_table(plan: Plan, memory_limit: float) -> str:
    """The ranked layouts, one per line, then each dropped reason with its count."""
    lines = [
        f"{'#':>2}  {'step s':>8}  {'tok/s/GPU':>10}  {'MFU':>6}  {'GiB/GPU':>8}  layout  (step: compute, "
        "exposed communication per dim, pipeline bubble)"
    ]
    for i, (layout, est) in enumerate(plan.ranked, 1):
        lines.append(
            f"{i:>2}  {est.step_time_s:>8.3f}  {est.tokens_per_sec_per_gpu:>10,.0f}  {100 * est.mfu:>5.1f}%  "
            f"{est.memory_bytes_per_gpu / GiB:>8.1f}  {layout.describe()}"
        )
        lines.append(f"{'':>42}{_breakdown(est)}")
    lines.append(f"{plan.examined} layouts examined, memory per GPU {memory_limit / GiB:.0f} GiB; dropped:")
    for reason, count in plan.refused.most_common():
        lines.append(f"  {count:>6}  {reason}")
    return "\n".join(lines)


def fits_nowhere(plan: Plan, memory_limit: float) -> str:
    """Why no layout was listed: the least memory any layout needs against what the GPU has."""
    if plan.least_memory is None:  # some fit in memory: the rules that dropped them come first
        ranked = sorted(plan.refused.most_common(), key=lambda rc: not rc[0].startswith("trainer rule"))
        reasons = "; ".join(f"{reason} ({count})" for reason, count in ranked[:3])
        return f"no layout of the {plan.examined} examined is valid: {reasons}"
    layout, est = plan.least_memory
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est.memory.items())
    return (
        f"the model fits nowhere on these GPUs: the layout needing the least memory ({layout.describe()}) "
        f"needs {est.memory_bytes_per_gpu / GiB:.1f} GiB per GPU (GiB: {parts}) but one GPU has "
        f"{memory_limit / GiB:.1f} GiB; use more GPUs, GPUs with more memory, a shorter sequence or a "
        "smaller model"
    )
