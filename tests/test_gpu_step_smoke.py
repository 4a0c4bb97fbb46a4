"""benchmarks/gpu_step.py's CPU path (tiny shapes, fp32), so that the GPU benchmark cannot rot between
the sessions that have a GPU: it must build both models from the same weights, agree on the first loss
and print its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_step_runs_its_cpu_smoke_path():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--out", "-"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "parity of the first loss: ok for every shape" in out.stdout
    for shape in ("tiny", "tiny-moe"):
        for impl in ("meshtron", "transformers"):
            assert f"| {shape} | {impl} |" in out.stdout
