"""A rank's measured resident peak against the planner's prediction: the small version of
benchmarks/big_model.py (a model bigger than one rank, under ZeRO-3 x 4, tp x pp and pp 4) and of
benchmarks/memory_vs_plan.py (26 stage rows within 10%). Fresh processes, since a resident peak
never falls: pipeline 2 x ZeRO-3 2, every stage's first rank within 15% of its prediction."""

from __future__ import annotations

import pytest

from meshtron.testing.peak_memory import FIXED_MMAP_THRESHOLD, MID_MODEL, measure_peak, predicted_stages
from meshtron.testing.workers import WorkerPool

MODEL = [*MID_MODEL, "--training.micro_batch=1"]
LAYOUT = ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=3"]


def measured_ratios(overrides: list[str]) -> dict[int, float]:
    """Each stage's first rank: measured peak (less the fixed overhead) / predicted, in fresh processes."""
    pool = WorkerPool(4, timeout_s=300)
    try:
        results = pool.run(measure_peak, overrides, 2)
    finally:
        pool.close()
    stages = predicted_stages(overrides, 4)
    firsts = sorted((r for r in results if r["first"]), key=lambda r: r["pp_rank"])
    assert [r["pp_rank"] for r in firsts] == [0, 1]
    return {r["pp_rank"]: (r["peak"] - r["fixed"]) / sum(stages[r["pp_rank"]].values()) for r in firsts}


def test_each_stages_peak_is_within_15_percent_of_the_planner(monkeypatch, tmp_path):
    """A resident peak also holds the process's passing non-tensor allocations (allocator arenas, gloo's
    buffers), which differ from run to run and only ever add: a stage above the bound is measured once
    more in fresh processes, and its lower reading counts."""
    for key, value in FIXED_MMAP_THRESHOLD.items():
        monkeypatch.setenv(key, value)
    overrides = [*MODEL, *LAYOUT, f"--run.dir={tmp_path}"]
    ratios = measured_ratios(overrides)
    if any(abs(r - 1) > 0.15 for r in ratios.values()):
        again = measured_ratios(overrides)
        ratios = {stage: min(r, again[stage]) for stage, r in ratios.items()}
    for stage, ratio in ratios.items():
        assert ratio == pytest.approx(1.0, rel=0.15), (stage, ratio)
