"""benchmarks/gpu_check.py's CPU path (tiny shapes, fp32), so that the one-GPU acceptance script cannot rot
between the sessions that have a GPU: its correctness checks must pass, gpu_step.py's table (which it
runs) must build both models from the same weights and agree on the first loss, and the memory section
must train every configuration it predicts, and planner_terms.py (which it runs) must time every term the
planner prices for an MoE layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_cpu_smoke_path():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", "-"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "correctness: every check within tolerance" in out.stdout
    checks = (
        "tiled",
        "grouped GEMM",
        "compile",
        "recompute: full",
        "KV cache",
        "safetensors",
        "pair lane",
        "float8",
    )
    for check in checks:
        assert check in out.stdout, check
    assert "parity of the first loss: ok for every shape" in out.stdout
    for shape in ("tiny", "tiny-moe"):
        for impl in ("meshtron", "transformers"):
            assert f"| {shape} | {impl} |" in out.stdout
    assert "| tiny | meshtron fp8 |" in out.stdout
    assert "async checkpoint published, equal to the run's weights: ok" in out.stdout
    assert "FAILED" not in out.stdout
    for configuration in ("| eager |", "| selective recompute |", "| full recompute |"):
        assert configuration in out.stdout, configuration
    terms = ("attention projections", "dense FFN or shared experts", "attention core, forward + backward",
             "routed experts, a loop of GEMMs", "routed experts, grouped", "permutation and combine, forward",
             "router, forward", "one-layer model of the rank's cut, forward + backward",
             "the same at 64 tokens: launches, the host's floor")  # fmt: skip
    for term in terms:
        assert f"| tiny MoE (smoke) | {term} |" in out.stdout, term
    assert "not measured" not in out.stdout
