"""Goodput under failures (plan/goodput.py): Young/Daly's interval is the best one, healing one replica
group against restarting the job, and `meshtron plan --failures-per-gpu-day`."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.checkpoint.save_load import _state
from meshtron.commands.main import main
from meshtron.plan.goodput import (
    FailureModel,
    checkpoint_interval_s,
    checkpoint_restart_goodput,
    healing_goodput,
)
from meshtron.plan.state import saved_bytes
from meshtron.rules.checks import load_config
from meshtron.testing.parity import trainer_for
from meshtron.testing.tiny import MOE, TINY

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


def checkpoint_bytes(overrides: list[str]) -> int:
    """The bytes of weights and optimizer state this rank puts in a checkpoint (before any step: the
    moments as a fresh optimizer has them)."""
    trainer = trainer_for(overrides)
    state, _ = _state(trainer.engine, trainer.optimizer, {}, trainer.job.tp_blocks)
    tensors = [*state["model"].values(), *(t for part in state["optimizer"].values() for t in part.values())]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0 and "expert_bias" not in str(t))


@pytest.mark.parametrize(
    "world, layout",
    [
        (1, []),
        (2, ["--parallel.zero=1", "--training.optimizer=muon"]),
        (4, ["--parallel.zero=3", "--model.vocab_size=301"]),  # its padded rows are not saved
        (4, ["--parallel.zero=3", *MOE, "--model.n_experts=2", "--parallel.ep=2"]),
    ],
    ids=["one rank", "muon zero1 x 2", "zero3 x 4 odd vocabulary", "zero3 moe ep2 x edp2"],
)
def test_saved_bytes_are_what_a_rank_writes(workers, world, layout):
    overrides = [*TINY, "--training.micro_batch=2", *layout]
    got = workers(world).run(checkpoint_bytes, overrides)[0]
    assert got == saved_bytes(load_config(None, overrides), world)
