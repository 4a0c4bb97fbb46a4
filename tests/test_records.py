"""What a run leaves to say what it was: config.toml (loads back to the same Config), environment.json, the
start-up lines, and the optional Weights & Biases logging (wiring checked with a stand-in wandb module;
the real package, offline, when it is installed)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from meshtron.config.loading import build_config, tomllib
from meshtron.config.schema import ConfigError
from meshtron.observe.metrics import MetricsLogger, scalars
from meshtron.observe.records import CONFIG_FILE, ENVIRONMENT_FILE
from meshtron.observe.wandb_log import RUN_ID_FILE, WandbSettings
from meshtron.rules.checks import check, load_config
from meshtron.testing.tiny import TINY
from meshtron.train.trainer import train

ENVIRONMENT_FIELDS = {
    "meshtron", "torch", "python", "platform", "host", "devices", "world_size", "ranks_per_node", "nodes",
    "mesh", "git", "command", "attempt", "resume", "started",
}  # fmt: skip


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init's arguments, the rows logged, whether it finished."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = 0

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        run_id = kwargs["id"] or f"run{len(self.inits)}"
        log = lambda data, step: self.logged.append((step, data))  # noqa: E731
        return types.SimpleNamespace(id=run_id, log=log, finish=self._finish)

    def _finish(self) -> None:
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_records_its_config_environment_and_wandb_scalars(tmp_path, fake_wandb, capsys):
    """One run, then its resume: each start writes config.toml (which loads back to the Config that ran)
    and environment.json, says what its long start-up phases do, and logs to W&B what TensorBoard gets;
    the resume overwrites the records and continues the same W&B run."""
    run_dir = tmp_path / "run"
    base = [*TINY, f"--run.dir={run_dir}", "--run.wandb_project=meshtron-test", "--checkpoint.every=2"]
    first_cfg = load_config(None, [*base, "--training.steps=2"])
    train(first_cfg)
    assert build_config(tomllib.loads((run_dir / CONFIG_FILE).read_text())) == first_cfg
    env = json.loads((run_dir / ENVIRONMENT_FILE).read_text())
    assert set(env) == ENVIRONMENT_FIELDS
    assert env["world_size"] == 1 and env["devices"]["type"] == "cpu" and env["resume"] is False
    assert env["mesh"]["summary"] == "mesh pp1 x dp_replicate1 x dp_shard1 x cp1 x tp1"
    assert env["mesh"]["groups"] == {}  # no dim of size > 1 on one rank
    assert env["git"] is None or len(env["git"]["commit"]) == 40
    out = capsys.readouterr().out
    assert "meshtron: building the model (tiny: 2 layers, dim 64, on cpu)" in out

    (init,) = fake_wandb.inits
    assert (init["project"], init["name"], init["id"]) == ("meshtron-test", "run", None)  # name: run.dir's
    assert init["dir"] == str(run_dir)
    assert init["config"]["training"]["steps"] == 2 and init["config"]["environment"] == env
    assert fake_wandb.logged == [(row["step"], scalars(row)) for row in rows_of(run_dir)]
    assert "loss" in fake_wandb.logged[0][1] and fake_wandb.finished == 1
    assert (run_dir / RUN_ID_FILE).read_text() == "run1\n"

    resumed_cfg = load_config(None, [*base, "--training.steps=3", "--checkpoint.resume=true"])
    train(resumed_cfg)
    assert build_config(tomllib.loads((run_dir / CONFIG_FILE).read_text())) == resumed_cfg
    assert json.loads((run_dir / ENVIRONMENT_FILE).read_text())["resume"] is True
    assert "meshtron: loading checkpoint " in capsys.readouterr().out
    assert (fake_wandb.inits[1]["id"], fake_wandb.inits[1]["resume"]) == ("run1", "allow")
    assert [step for step, _ in fake_wandb.logged] == [1, 2, 3]
    assert not list(run_dir.glob(".*.tmp-*"))  # the atomic writes left nothing behind


def test_wandb_without_the_package_is_refused_at_config_time(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is missing
    cfg = load_config(None, ["--run.wandb_project=p"])
    with pytest.raises(ConfigError, match=r"wandb_project='p' needs the wandb package.*meshtron\[wandb\]"):
        check(cfg)
    check(load_config(None, []))  # off by default: nothing to install


def test_wandb_logs_on_rank_0_only(tmp_path, fake_wandb):
    settings = WandbSettings("p", "n", tmp_path)
    other_rank = MetricsLogger(tmp_path, enabled=False, tensorboard=False, wandb=settings)
    other_rank.log({"step": 1, "loss": 2.0})
    other_rank.close()
    assert fake_wandb.inits == [] and fake_wandb.logged == []


def test_wandb_offline_with_the_real_package(tmp_path, monkeypatch):
    """The real wandb, offline: the run is written under run.dir/wandb (skipped when wandb is not
    installed, as in CI: the wiring is tested above with a stand-in)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=WandbSettings("p", "n", tmp_path))
    for step in (1, 2):
        logger.log({"step": step, "loss": 3.0 / step, "comm_bytes_by_group": {"dp": 1}})
    logger.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb")) and (tmp_path / RUN_ID_FILE).is_file()


def test_a_resumed_runs_pictures_show_its_earlier_steps_too(tmp_path):
    """loss.png after a resume showed only the resumed steps, though metrics.jsonl held them all: the
    logger keeps the file's earlier rows (history), apart from this attempt's (its summary's)."""
    earlier = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)] + [{"step": 2, "val_loss": 4.5}]
    lost = [{"step": 4, "loss": 0.5}]  # after the checkpoint at step 3: computed again by the resumed run
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier + lost))
    logger = MetricsLogger(tmp_path, enabled=True, append=True, tensorboard=False, last_step=3)
    logger.log({"step": 4, "loss": 1.0})
    logger.close()
    rows, eval_rows = logger.history()
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    assert eval_rows == [{"step": 2, "val_loss": 4.5}] and logger.rows == [{"step": 4, "loss": 1.0}]
