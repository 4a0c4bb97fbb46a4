"""Checkpoint formats: one written before the public-API blocks (format 1, torch ShardedTensors for the
tp/ep shards) still loads into every layout, and a newer format is refused by name.

tests/data/checkpoint-format-1 was written by meshtron at commit 59a7e0a (torch 2.13) after one step of
the tiny MoE under tp 2 + sp, ep 2 and ZeRO-3 over dp_shard 2 (4 ranks); its `losses.json` holds that
uninterrupted run's first three losses, as the writing code computed them: a run resumed from it must
compute its steps 2 and 3 again (the initialisation has changed since, which a resumed run never reads).
"""

from __future__ import annotations

import json
import math
import shutil
import unittest.mock
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import meshtron.checkpoint.save_load as checkpoint_module
from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.safe_reader import SafeFileSystemReader
from meshtron.checkpoint.save_load import FORMAT, FORMAT_FILE, check_format, load_model_weights
from meshtron.models.llama import Transformer
from meshtron.rules.checks import load_config
from meshtron.testing.parity import assert_losses_match, relative, train_rows, trainer_for
from meshtron.testing.tiny import TINY

FIXTURE = Path(__file__).parent / "data" / "checkpoint-format-1"
WRITTEN_LOSSES = json.loads((FIXTURE.parent / "checkpoint-format-1.losses.json").read_text())
SINGLE = ["--parallel.tp=1", "--parallel.sp=false", "--parallel.ep=1", "--run.sample_tokens=0"]
LAYOUTS = {
    # name: (world, overrides on top of the fixture's config)
    "single": (1, SINGLE),
    "as_written": (4, ["--run.sample_tokens=0"]),
    "cp2_ep2_zero2": (4, [*SINGLE, "--parallel.cp=2", "--parallel.ep=2", "--parallel.zero=2"]),
}


def resumed_rows(workers, tmp_path: Path, layout: str, steps: int = 4) -> list[dict]:
    """The fixture's run resumed from its step-1 checkpoint (a copy) on `layout`, to `steps` steps."""
    world, overrides = LAYOUTS[layout]
    (tmp_path / "ck").mkdir()
    shutil.copytree(FIXTURE, tmp_path / "ck" / "step-00000001")
    resumed = [
        *overrides,
        f"--training.steps={steps}",
        "--checkpoint.resume=true",
        "--checkpoint.keep=4",
        f"--checkpoint.dir={tmp_path / 'ck'}",
        f"--run.dir={tmp_path / 'run'}",
    ]
    return workers(world).run(train_rows, resumed, FIXTURE / "config.toml")[0]


@pytest.fixture(scope="module")
def on_one_device(workers, tmp_path_factory) -> tuple[list[dict], Path]:
    """The fixture resumed on one device, every step checkpointed: (rows, its checkpoint of step 2)."""
    tmp = tmp_path_factory.mktemp("single")
    rows = resumed_rows(workers, tmp, "single", steps=4)
    return rows, tmp / "ck" / "step-00000002"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_format_1_checkpoint_resumes_on_any_layout(workers, tmp_path, on_one_device, layout):
    """Resumed on any layout, the run continues the one that wrote the checkpoint: its steps 2 and 3 are
    the losses the writing code computed, and every layout agrees on step 4 too."""
    rows = on_one_device[0] if layout == "single" else resumed_rows(workers, tmp_path, layout)
    assert [r["step"] for r in rows] == [2, 3, 4]
    for row, want in zip(rows[:2], WRITTEN_LOSSES[1:], strict=True):
        assert relative(row["loss"], want) <= 1e-5, (row["step"], row["loss"], want)
    assert_losses_match(rows, on_one_device[0])


def test_format_1_and_format_2_checkpoints_hold_the_same_kind_of_state(on_one_device):
    """load_model_weights (export, generate) reads both formats: the format-2 checkpoint the resumed run
    wrote after one more step holds the fixture's weights moved by one small optimizer step."""
    cfg = load_config(FIXTURE / "config.toml", SINGLE)
    ck = on_one_device[1]
    assert json.loads((ck / FORMAT_FILE).read_text())["format"] == FORMAT
    old_model, new_model = Transformer(cfg.model), Transformer(cfg.model)
    load_model_weights(FIXTURE, old_model)
    load_model_weights(ck, new_model)
    new_params = dict(new_model.named_parameters())  # (the balancing bias may step back to zero)
    for name, old in old_model.named_parameters():
        assert (
            0 < float((old - new_params[name]).detach().norm() / new_params[name].detach().norm()) <= 0.25
        ), name


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


def tensor_bytes_read_resuming(overrides: list[str]) -> int:
    """On every rank: the tensor bytes this rank's checkpoint reader read while the trainer resumed."""
    readers: list[SafeFileSystemReader] = []

    class Counting(SafeFileSystemReader):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            readers.append(self)

    with unittest.mock.patch.object(checkpoint_module, "SafeFileSystemReader", Counting):
        trainer_for(overrides)
    return sum(r.tensor_bytes_read for r in readers)


def test_resuming_on_another_layout_reads_only_each_ranks_rows(workers, tmp_path):
    """A one-device checkpoint resumed under ZeRO-3 over 2 ranks: each rank reads only the rows it holds
    (checkpoint/saved_regions.py), so the two together read every saved element once (and the replicated train
    state twice), and each about half, where torch's reader would read the whole checkpoint on each."""
    common = [*TINY, "--run.sample_tokens=0", f"--checkpoint.dir={tmp_path / 'ck'}", "--checkpoint.keep=2"]
    workers(1).run(train_rows, [*common, "--training.steps=1", "--checkpoint.every=1"])
    saved = SafeFileSystemReader(str(tmp_path / "ck" / "step-00000001")).read_metadata()
    nbytes = {
        fqn: math.prod(meta.size) * meta.properties.dtype.itemsize
        for fqn, meta in saved.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0  # (0-d: read whole, not boxes)
    }
    sharded = sum(n for fqn, n in nbytes.items() if not fqn.startswith("train."))
    replicated = sum(n for fqn, n in nbytes.items() if fqn.startswith("train."))
    resumed = [*common, "--training.steps=2", "--checkpoint.resume=true", "--parallel.dp_shard=2",
               "--parallel.zero=3", "--training.micro_batch=4"]  # fmt: skip
    read = workers(2).run(tensor_bytes_read_resuming, resumed)
    assert sum(read) == sharded + 2 * replicated
    for rank_bytes in read:
        assert 0.4 * sharded <= rank_bytes - replicated <= 0.6 * sharded, (read, sharded)
