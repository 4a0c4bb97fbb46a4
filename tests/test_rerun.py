"""Issue 45.7: a new run over a run directory whose earlier run left metrics.jsonl (and no checkpoint)
is refused, as one over checkpoints is, before any rank starts; resume and restarts go on appending."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from meshtron.checkpoint import CheckpointError
from meshtron.commands.main import main
from meshtron.rules.checks import load_config
from meshtron.testing.tiny import TINY
from meshtron.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.toml")
EARLIER = "".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2, 3))


def refusal(path: Path, rows: int) -> str:
    return (
        f"meshtron: error: {path} already holds {rows} rows of an earlier run, and no checkpoint to continue "
        "from; a new run would replace them: use another run.dir, delete the file to start afresh here, or set "
        "--checkpoint.resume=true to start again from step 1 over them\n"
    )


def test_a_rerun_over_metrics_is_refused_before_any_rank_starts(fixed_cpu, nothing_starts, capsys):
    metrics = nothing_starts / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(EARLIER)
    for launch in ([], ["--nproc", "2"]):  # nothing_starts: neither train nor the launcher is called
        assert main(["train", "--config", DEMO, "--run.dir=run", *launch]) == 2
        assert capsys.readouterr().err == refusal(Path("run") / "metrics.jsonl", 3)
    assert metrics.read_text() == EARLIER
    with pytest.raises(AssertionError, match="started something"):  # resume: it goes on
        main(["train", "--config", DEMO, "--run.dir=run", "--checkpoint.resume=true"])
    metrics.write_text("")  # an earlier run that logged nothing loses nothing
    with pytest.raises(AssertionError, match="started something"):
        main(["train", "--config", DEMO, "--run.dir=run"])


def test_a_rerun_over_checkpoints_is_refused_before_any_rank_starts(fixed_cpu, nothing_starts, capsys):
    (nothing_starts / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (nothing_starts / "run" / "checkpoints" / "step-00000004" / ".metadata").write_text("")
    assert main(["train", "--config", DEMO, "--run.dir=run", "--nproc", "2"]) == 2
    assert capsys.readouterr().err == (
        "meshtron: error: run/checkpoints already holds checkpoints (newest: step 4); set "
        "--checkpoint.resume=true to continue from it, or use another run.dir / checkpoint.dir\n"
    )


def test_launched_ranks_refuse_it_too_unless_restarted(tmp_path, monkeypatch):
    """Under torchrun the ranks are the first to see run.dir; a restart (a rank died) starts again over
    its own metrics. Called as a library, train() replaces them as before."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(EARLIER)
    cfg = load_config(None, [*TINY, "--training.steps=2", f"--run.dir={tmp_path}", "--run.sample_tokens=0"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with pytest.raises(CheckpointError, match="already holds 3 rows of an earlier run"):
        train(cfg)
    dist.destroy_process_group()  # the refused set-up's (a library caller's to end)
    assert metrics.read_text() == EARLIER
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert [r["step"] for r in train(cfg)] == [1, 2]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
