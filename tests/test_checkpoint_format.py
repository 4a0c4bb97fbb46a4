"""Checkpoint formats: one written before the public-API blocks (format 1, torch ShardedTensors for the
tp/ep shards) still loads into every layout, and a newer format is refused by name.

tests/data/checkpoint-format-1 was written by meshtron at commit 59a7e0a (torch 2.13) after one step of
the tiny MoE under tp 2 + sp, ep 2 and ZeRO-3 over dp_shard 2 (4 ranks); its `losses.json` holds that
uninterrupted run's first three losses, as the writing code computed them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshtron.checks import load_config
from meshtron.models.llama import Transformer
from meshtron.testing.parity import assert_losses_match, relative, train_rows
from meshtron.train import CheckpointError
from meshtron.train.checkpoint import FORMAT, FORMAT_FILE, check_format, load_model_weights

FIXTURE = Path(__file__).parent / "data" / "checkpoint-format-1"
WRITTEN_LOSSES = json.loads((FIXTURE.parent / "checkpoint-format-1.losses.json").read_text())
SINGLE = ["--parallel.tp=1", "--parallel.sp=false", "--parallel.ep=1", "--run.sample_tokens=0"]
LAYOUTS = {
    # name: (world, overrides on top of the fixture's config)
    "single": (1, SINGLE),
    "as_written": (4, ["--run.sample_tokens=0"]),
    "cp2_ep2_zero2": (4, [*SINGLE, "--parallel.cp=2", "--parallel.ep=2", "--parallel.zero=2"]),
}


@pytest.fixture(scope="module")
def straight(workers, tmp_path_factory) -> tuple[list[dict], Path]:
    """The uninterrupted single-device run of the fixture's config, 4 steps, keeping its checkpoints of
    every step: (rows, its checkpoint of step 1)."""
    run = tmp_path_factory.mktemp("straight")
    overrides = [
        *SINGLE,
        "--training.steps=4",
        "--checkpoint.keep=4",
        f"--run.dir={run}",
        f"--checkpoint.dir={run / 'ck'}",
    ]
    rows = workers(1).run(train_rows, overrides, FIXTURE / "config.toml")[0]
    # The data and the model are what the fixture was written with: the same first losses.
    assert [relative(r["loss"], want) <= 1e-5 for r, want in zip(rows[:3], WRITTEN_LOSSES, strict=True)] == [
        True
    ] * 3
    return rows, run / "ck" / "step-00000001"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_format_1_checkpoint_resumes_on_any_layout(workers, tmp_path, straight, layout):
    world, overrides = LAYOUTS[layout]
    (tmp_path / "ck").mkdir()
    shutil.copytree(FIXTURE, tmp_path / "ck" / "step-00000001")
    resumed = [
        *overrides,
        "--training.steps=4",
        "--checkpoint.resume=true",
        f"--checkpoint.dir={tmp_path / 'ck'}",
        f"--run.dir={tmp_path / 'run'}",
    ]
    rows = workers(world).run(train_rows, resumed, FIXTURE / "config.toml")[0]
    assert_losses_match(rows, straight[0][1:])


def test_format_1_weights_equal_a_format_2_checkpoint_of_the_same_step(straight):
    """load_model_weights (export, generate) reads both formats; the step-1 weights agree to fp32
    rounding of the two layouts that computed them."""
    cfg = load_config(FIXTURE / "config.toml", SINGLE)
    ck = straight[1]
    assert json.loads((ck / FORMAT_FILE).read_text())["format"] == FORMAT
    old_model, new_model = Transformer(cfg.model), Transformer(cfg.model)
    load_model_weights(FIXTURE, old_model)
    load_model_weights(ck, new_model)
    new_sd = new_model.state_dict()
    for name, old in old_model.state_dict().items():
        assert float((old - new_sd[name]).norm() / new_sd[name].norm()) <= 1e-5, name


def test_a_newer_format_is_refused_by_name(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "ck")
    (tmp_path / "ck" / FORMAT_FILE).write_text(
        json.dumps({"format": FORMAT + 1, "meshtron": "9.0", "torch": "9.9"})
    )
    with pytest.raises(CheckpointError, match=rf"format {FORMAT + 1}, written by meshtron 9.0.*upgrade"):
        check_format(tmp_path / "ck")
    model = Transformer(load_config(FIXTURE / "config.toml", SINGLE).model)
    with pytest.raises(CheckpointError, match="upgrade meshtron"):
        load_model_weights(tmp_path / "ck", model)
    (tmp_path / "ck" / FORMAT_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        check_format(tmp_path / "ck")
    check_format(FIXTURE)  # no format file: format 1
