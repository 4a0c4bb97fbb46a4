"""`meshtron train --parallel.auto=true` (issue 33.3): the planner picks the layout before any rank
starts, holding every key the user set; the pick trains and matches one device; refusals say why."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from meshtron.commands.auto_layout import choose_layout, explicit_keys, held_keys
from meshtron.commands.main import main
from meshtron.config.loading import build_config, tomllib
from meshtron.config.schema import ConfigError
from meshtron.observe.records import AUTO_LAYOUT_ENV
from meshtron.plan.estimate import Cluster
from meshtron.rules.checks import load_config
from meshtron.testing.parity import assert_losses_match, train_rows
from meshtron.testing.tiny import TINY

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.toml")


@pytest.fixture(autouse=True)
def no_choice_left_behind():
    """A choice made in this process is left in the environment for the ranks' environment.json; the
    tests after these must not see it."""
    yield
    os.environ.pop(AUTO_LAYOUT_ENV, None)


def test_held_keys_are_those_set_in_the_file_or_the_overrides(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[parallel]\ncp = 1\ndp_shard = -1\nbucket_mb = 10\n[training]\nrecompute = "full"\n')
    overrides = ["--parallel.tp=2", "--training.steps=3", "--parallel.auto=true"]
    explicit = explicit_keys(config, overrides)
    assert {"parallel.cp", "parallel.tp", "training.recompute", "training.steps"} <= explicit
    cfg = load_config(config, overrides)
    # dp_shard = -1 is "the rest", not a choice; bucket_mb is not a layout key; steps are not either.
    assert held_keys(cfg, explicit) == {"tp": 2, "cp": 1, "recompute": "full"}


def test_dry_run_prints_the_top_three_and_trains_the_first(fixed_cpu, nothing_starts, capsys):
    assert (
        main(
            [
                "train",
                "--config",
                DEMO,
                "--nproc",
                "4",
                "--parallel.auto=true",
                "--parallel.tp=2",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    head, config = out.split("# resolved config")
    lines = head.splitlines()
    assert (
        lines[0].startswith("parallel.auto: the planner's fastest layouts on ")
        and "(held: tp=2, micro_batch=4)" in lines[0]
    )
    ranked = [line.split("  ")[-1] for line in lines[1:4]]
    assert [line.strip()[:2] for line in lines[1:4]] == ["1.", "2.", "3."]
    assert all(layout.startswith("tp=2,") and "micro_batch=4" in layout for layout in ranked)  # held
    assert lines[4].startswith("  chosen: 1. ") and "faster than 2." in lines[4]
    resolved = build_config(tomllib.loads(config.split("\n", 1)[1].split("# mesh")[0]))
    assert resolved.parallel.tp == 2 and resolved.parallel.auto is False
    assert f"# prediction for layout {ranked[0]}" in out


def test_nothing_fits_is_refused_with_what_is_short(fixed_cpu, nothing_starts, monkeypatch, capsys):
    small = dataclasses.replace(fixed_cpu.cpu_cluster(1).gpu, memory_bytes=2**20)
    monkeypatch.setattr(fixed_cpu, "cpu_cluster", lambda ranks: Cluster(small, ranks, "fp32"))
    assert main(["train", "--config", DEMO, "--nproc", "2", "--parallel.auto=true", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "parallel.auto on 2 ranks: the model fits nowhere on these GPUs" in err and "GiB per GPU" in err


def test_under_torchrun_on_a_cpu_it_needs_the_cached_measurement(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = load_config(None, [*TINY, "--parallel.auto=true"])
    with pytest.raises(ConfigError, match="run `meshtron plan --gpu cpu --gpus 2 ...` once"):
        choose_layout(cfg, 2, set(), under_launcher=True)


@pytest.mark.parametrize("world, held", [(2, []), (4, ["--parallel.tp=2"])])
def test_the_chosen_layout_trains_and_matches_one_device(fixed_cpu, workers, world, held):
    base = [*TINY, "--training.steps=3", "--run.sample_tokens=0"]
    cfg = load_config(None, [*base, "--parallel.auto=true", *held])
    choice = choose_layout(cfg, world, explicit_keys(None, held), under_launcher=False)
    layout = choice.ranked[0][0]
    assert layout.world_size == world and (layout.tp == 2 or not held)
    want = workers(1).run(train_rows, base)[0]
    assert_losses_match(workers(world).run(train_rows, [*base, *choice.rank_flags()])[0], want)


def test_a_launched_run_records_the_choice(tmp_path):
    """`--nproc 2` with the real CPU probe: config.toml holds the chosen keys, environment.json the choice."""
    from test_cli import NPROC_COMMON, meshtron

    run = tmp_path / "run"
    out = meshtron("train", *NPROC_COMMON, "--nproc", "2", "--parallel.auto=true", f"--run.dir={run}")
    assert out.returncode == 0, out.stderr
    assert "parallel.auto: the planner's fastest layouts on this machine's CPU" in out.stdout
    chosen = json.loads((run / "environment.json").read_text())["auto_layout"]["chosen"]
    recorded = load_config(run / "config.toml")
    assert recorded.parallel.auto is False
    described = dict(item.split("=") for item in chosen.split(","))
    assert (
        int(described["tp"]) == recorded.parallel.tp
        and int(described["dp_shard"]) == recorded.parallel.dp_shard
    )
    assert described["recompute"] == recorded.training.recompute


def test_why_the_first_won_says_the_tie_break_it_took():
    """Two layouts of one step time to 4 figures were "0.0% faster ... (ties go to less memory)" even
    with equal memory: a tie says which key broke it (plan/search.py's rank_key), a gain its size."""
    from meshtron.commands.auto_layout import why_first
    from meshtron.plan.estimate import estimate
    from meshtron.plan.hardware import GiB, accelerator
    from meshtron.plan.layout import Layout

    layout = Layout(dp_shard=2, zero=1, micro_batch=1)
    est = estimate(layout.apply(load_config(DEMO, [])), Cluster(accelerator("h100"), 2))
    step, memory = est.step_time_s, est.memory_bytes_per_gpu

    def pair(step2: float, memory2: float) -> str:
        other = dataclasses.replace(est, step_time_s=step2, memory_bytes_per_gpu=memory2)
        return why_first([(layout, est), (layout, other)])

    assert pair(step, memory + GiB) == (
        f"as fast as 2. to 4 figures ({step:.4g} s), with less memory: {memory / GiB:.3f} GiB against "
        f"{memory / GiB + 1:.3f} GiB per rank"
    )
    assert pair(step * (1 + 1e-5), memory) == (
        f"as fast as 2. to 4 figures ({step:.4g} s) and the same memory; unrounded, {step:.6g} s against "
        f"{step * (1 + 1e-5):.6g} s"
    )
    assert (
        pair(step, memory)
        == f"as fast as 2. to 4 figures ({step:.4g} s), the same memory: the first of the two the search tried"
    )
    assert pair(step * 1.0004, memory).startswith("0.04% faster than 2., mostly in ")
