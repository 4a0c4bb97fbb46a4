"""`meshtron verify`: the shrunk model keeps the architecture and layout; the command compares a layout
with one device and fails beyond its tolerance."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshtron.config import check, load_config
from meshtron.verify import shrink, to_overrides


@pytest.mark.parametrize(
    "config, overrides, world",
    [
        ("configs/llama3-70b.toml", [], 256),
        ("configs/mixtral-8x7b.toml", [], 64),
        ("configs/deepseek-moe.toml", [], 64),
        ("configs/long-context.toml", [], 4),
        (
            "configs/llama3-8b.toml",
            ["--parallel.pp=4", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved"],
            32,
        ),
    ],
)
def test_shrunk_model_keeps_architecture_and_layout(config, overrides, world):
    cfg = load_config(config, overrides)
    small = shrink(cfg, world)
    check(small, world)  # still a valid layout on as many ranks
    m, s = cfg.model, small.model
    assert (s.n_heads, s.kv_heads, s.n_experts, s.top_k, s.router, s.tie_embeddings) == (
        m.n_heads, m.kv_heads, m.n_experts, m.top_k, m.router, m.tie_embeddings,
    )  # fmt: skip
    assert (s.n_shared_experts, s.n_expert_groups, s.router_bias_rate, s.balance_loss) == (
        m.n_shared_experts, m.n_expert_groups, m.router_bias_rate, m.balance_loss,
    )  # fmt: skip
    assert small.parallel == cfg.parallel.__class__(**{**vars(cfg.parallel), "pp_layers": []})
    assert s.dim * s.n_layers < 50_000 and small.training.dtype == "fp32"
    assert load_config(None, to_overrides(small)) == small  # what the worker processes rebuild


def verify_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtron.cli", "verify", *args], capture_output=True, text=True, timeout=600
    )


def test_verify_passes_a_correct_layout_and_fails_beyond_tolerance():
    layout = ["--config", "configs/tiny-moe.toml", "--nproc", "4", "--steps", "3"]
    layout += ["--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_shard=2", "--parallel.ep=2"]
    out = verify_cli(*layout)
    assert out.returncode == 0, out.stderr
    assert "meshtron verify: OK" in out.stdout and "experts" in out.stdout and "router" in out.stdout
    assert "counted/formula" in out.stdout and " ep " in out.stdout and " tp " in out.stdout
    strict = verify_cli(*layout, "--tolerance", "0")  # fp32 rounding differs between layouts
    assert strict.returncode == 1 and "MISMATCH" in strict.stdout
