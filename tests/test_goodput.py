"""Goodput under failures (plan/goodput.py): Young/Daly's interval is the best one, healing one replica
group against restarting the job, and `meshtron plan --failures-per-gpu-day`."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.commands.main import main
from meshtron.plan.goodput import (
    FailureModel,
    checkpoint_interval_s,
    checkpoint_restart_goodput,
    healing_goodput,
)

# Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3 = FailureModel(
    failures_per_gpu_day=419 / (54 * 16_384),
    gpus=16_384,
    step_s=8.0,
    state_bytes=2.0e9,
    storage_bytes_per_s=2e12 / 16_384,
    network_bytes_per_s=50e9,
    restart_s=120.0,
)


def test_the_job_fails_every_three_hours_at_llama_3s_rate():
    assert LLAMA3.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)


@pytest.mark.parametrize("checkpoint_bytes", [2e8, 2e9, 2e10])
def test_daly_interval_is_the_best_interval(checkpoint_bytes):
    f = dataclasses.replace(LLAMA3, state_bytes=checkpoint_bytes)
    best = checkpoint_interval_s(f.checkpoint_s, f.mtbf_s)
    grid = [best * k / 100 for k in range(20, 400)]
    scanned = max(grid, key=lambda tau: checkpoint_restart_goodput(f, tau))
    assert scanned == pytest.approx(best, rel=0.05)
    assert checkpoint_restart_goodput(f) >= checkpoint_restart_goodput(f, scanned) - 1e-4


def test_healing_loses_a_step_and_one_replicas_restart_per_failure():
    for replicas in (2, 8, 64):
        lost = LLAMA3.step_s + (LLAMA3.restart_s + LLAMA3.state_bytes / 50e9) / replicas
        assert healing_goodput(LLAMA3, replicas) == pytest.approx(1 - lost / LLAMA3.mtbf_s)
    assert healing_goodput(LLAMA3, 2) > checkpoint_restart_goodput(LLAMA3)
    with pytest.raises(ValueError, match="dp_replicate >= 2"):
        healing_goodput(LLAMA3, 1)
    # Failures faster than a restart leave nothing.
    assert checkpoint_restart_goodput(dataclasses.replace(LLAMA3, failures_per_gpu_day=1.0)) == 0.0


def test_plan_reports_goodput_of_its_first_layout(capsys):
    args = ["plan", "--model.name=llama3-8b", "--gpus", "64", "--gpu", "h100", "--seq-len", "4096"]
    args += ["--global-batch", "256", "--top", "1", "--failures-per-gpu-day", "0.01"]
    assert main([*args, "--layout", "dp_replicate=2"]) == 0
    out = capsys.readouterr().out
    assert "one every 2,250.0 min" in out  # 86,400 s / (0.01 x 64)
    assert "checkpoint-restart: save" in out and "replica healing: 1 of 2 replica groups" in out
    assert main([*args, "--layout", "dp_replicate=1"]) == 0
    assert "needs dp_replicate >= 2" in capsys.readouterr().out
    assert main([*args, "--storage-gbps", "0"]) == 2
    assert "--storage-gbps must be positive" in capsys.readouterr().err
