"""Runs that survive faults: non-finite steps skipped without changing anything, a diverging run stopped
with a message and a non-zero exit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.integrity import corrupt_files
from meshtron.comm.collectives import Comm
from meshtron.comm.group import CollectiveTimeout, CommGroup
from meshtron.comm.workers import WorkerPool, close_pools
from meshtron.testing.parity import train_rows, trainer_for
from meshtron.testing.tiny import MOE, TINY

POISONED = "layers.1.attention.wq.weight"


def skip_one_step(overrides: list[str]) -> dict:
    """On every rank: step 1 normal; step 2 with a NaN gradient on the last rank only (a hook on one
    weight); step 3 normal again. Returns the rows and whether step 2 changed any optimizer tensor."""
    trainer = trainer_for(overrides)
    rows = [trainer.step(0)]
    params = {id(p): p.detach().clone() for p in trainer.engine.optimizer_params()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    weight = dict(trainer.model.named_parameters())[POISONED]
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")) if last else g)
    rows.append(trainer.step(1))
    hook.remove()
    unchanged = all(torch.equal(p, params[id(p)]) for p in trainer.engine.optimizer_params()) and all(
        torch.equal(v, state[id(p)][k]) for p, s in trainer.optimizer.state.items() for k, v in s.items()
    )
    rows.append(trainer.step(2))
    return {"rows": rows, "unchanged": unchanged}


def test_a_non_finite_step_is_skipped_and_changes_nothing(workers):
    """Under ZeRO-3 over 2 ranks with MoE, a NaN gradient on one rank's shard: every rank skips the step
    (no parameter or AdamW change), the row names the parameter, and the next step trains normally."""
    for result in workers(2).run(skip_one_step, [*TINY, *MOE, "--training.micro_batch=4"]):
        first, skipped, after = result["rows"]
        assert result["unchanged"]
        assert skipped["skipped"] and skipped["nonfinite"] == "grad norm"
        assert skipped["first_nonfinite_grad"] == POISONED
        assert "skipped" not in first and "skipped" not in after
        assert torch.isfinite(torch.tensor(after["grad_norm"]))


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`meshtron train` on the demo config shrunk to the tiny model, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--config", "configs/demo.toml", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_a_diverging_run_stops_with_a_message(tmp_path):
    """lr = 1e30: the second step's gradients overflow; after training.max_skipped_steps skips in a row
    the run stops with exit status 3 and says what to change."""
    out = run_cli(
        [
            "--training.steps=10",
            "--training.lr=1e30",
            "--training.warmup_steps=1",
            "--training.max_skipped_steps=2",
            f"--run.dir={tmp_path}",
        ]
    )
    assert out.returncode == 3, out.stderr
    assert "3 non-finite steps in a row (training.max_skipped_steps=2)" in out.stderr
    assert "lower training.lr" in out.stderr
    assert out.stdout.count("SKIPPED") == 2


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def corrupt(path: str) -> list[str]:
    return corrupt_files(Path(path), Comm(), CommGroup("world", (0,), None))


def test_a_corrupt_checkpoint_is_named_and_resume_falls_back(workers, tmp_path):
    """Truncate one file of the newest checkpoint: it is reported corrupt by name, resuming falls back
    to the previous checkpoint, and the run still ends as the uninterrupted one does."""
    base = [*TINY, "--training.micro_batch=8", "--checkpoint.keep=2"]
    straight = workers(1).run(
        train_rows, [*base, "--training.steps=6", f"--run.dir={tmp_path / 'straight'}"]
    )[0]
    saving = [*base, "--checkpoint.every=2", f"--run.dir={tmp_path / 'run'}"]
    workers(1).run(train_rows, [*saving, "--training.steps=4"])
    newest = tmp_path / "run" / "checkpoints" / "step-00000004"
    victim = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: size // 2])
    assert workers(1).run(corrupt, str(newest)) == [
        [f"{victim.name} has {size // 2} bytes, {size} were written"]
    ]
    assert workers(1).run(corrupt, str(newest.parent / "step-00000002")) == [[]]
    resumed = workers(1).run(train_rows, [*saving, "--training.steps=6", "--checkpoint.resume=true"])[0]
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]  # from step 2: the corrupt step 4 was skipped
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]


def resume_said(overrides: list[str]) -> str:
    """What a resume prints, and the error it stops with."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            train_rows(overrides)
        except CheckpointError as err:
            print(f"error: {err}")
    return out.getvalue()


def test_the_only_checkpoint_corrupt_says_no_older_one_is_left(workers, tmp_path):
    """It said "falling back to the previous complete checkpoint", then "every checkpoint is corrupt"."""
    from meshtron.commands.export import resolve_checkpoint

    saving = [*TINY, "--training.micro_batch=8", "--checkpoint.every=2", f"--run.dir={tmp_path}"]
    workers(1).run(train_rows, [*saving, "--training.steps=2"])
    only = tmp_path / "checkpoints" / "step-00000002"
    victim = next(p for p in only.iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-1])
    said = workers(1).run(resume_said, [*saving, "--training.steps=4", "--checkpoint.resume=true"])[0]
    assert f"checkpoint {only} is corrupt (" in said and "); no older one is left" in said
    assert "falling back" not in said
    assert f"error: the only checkpoint in {only.parent} is corrupt; start a new run.dir" in said
    with pytest.raises(CheckpointError, match=f"^the only checkpoint in {only.parent} is corrupt$"):
        resolve_checkpoint(tmp_path)


def test_an_unwritable_run_directory_is_reported_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_cli(["--training.steps=2", f"--run.dir={blocker / 'run'}"])
    assert out.returncode == 2 and "is not writable" in out.stderr and "set run.dir" in out.stderr
    assert "step " not in out.stdout


def save_poisoned(overrides: list[str], root: str) -> str:
    trainer = trainer_for([*overrides, f"--checkpoint.dir={root}"])
    with torch.no_grad():
        dict(trainer.model.named_parameters())["norm.weight"].fill_(float("nan"))
    try:
        trainer.save(1)
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_a_checkpoint_never_holds_non_finite_values(workers, tmp_path):
    for message in workers(2).run(
        save_poisoned, [*TINY, "--parallel.zero=1", "--training.micro_batch=4"], str(tmp_path / "ckpt")
    ):
        assert "non-finite values in norm.weight" in message
    assert not any((tmp_path / "ckpt").glob("step-*"))


def killed_and_restarted(run_dir: Path, steps: int, drill: dict[str, str]) -> tuple[str, list[dict]]:
    """Two ranks with checkpoints every 2 steps, one killed by `drill` (an environment) and restarted once:
    (the killed run's output, its metrics rows), after checking that it finished, logged every step once
    and gave the uninterrupted run's losses exactly."""
    common = ["--nproc=2", f"--training.steps={steps}", "--training.micro_batch=4", "--checkpoint.every=2"]
    straight = run_cli([*common, f"--run.dir={run_dir / 'straight'}"])
    assert straight.returncode == 0, straight.stderr
    killed = ["--max-restarts=1", f"--run.dir={run_dir / 'killed'}"]
    out = run_cli([*common, *killed], env={**os.environ, **drill})
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == losses(run_dir / "straight")
    return out.stdout, rows


def test_a_rank_killed_mid_run_restarts_and_loses_nothing(tmp_path):
    """Rank 1 dies right after step 5. The launcher restarts both ranks, they resume from step 4, and the
    run ends with one metrics row per step and the losses of an uninterrupted run, exactly."""
    stdout, _ = killed_and_restarted(tmp_path, 7, {"MESHTRON_KILL_AT": "1:5"})
    assert "resumed from" in stdout and "step-00000004 at step 4" in stdout


def test_a_rank_sigkilled_as_a_step_begins_restarts_and_loses_nothing(tmp_path):
    """MESHTRON_KILL_RANK=1:4: rank 1 dies by SIGKILL as step 4 begins, rank 0 waiting in that step's
    collectives. The launcher restarts both from the step-2 checkpoint; every step is logged once, with
    the uninterrupted run's losses."""
    stdout, _ = killed_and_restarted(tmp_path, 5, {"MESHTRON_KILL_RANK": "1:4"})
    assert "step-00000002 at step 2" in stdout


def skip_a_collective(timeout_s: float) -> str:
    """Two all-reduces on a fresh group; the last rank skips the second. Returns the error (or "skipped")."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    comm = Comm(timeout_s=timeout_s)
    group = CommGroup("hang_test", tuple(range(world)), torch.distributed.new_group(list(range(world))))
    comm.all_reduce_(torch.ones(4), group)
    if rank == world - 1:
        return "skipped"
    try:
        comm.all_reduce_(torch.ones(4), group)
    except CollectiveTimeout as err:
        return str(err)
    return "completed"


def test_a_hang_names_the_rank_that_fell_behind():
    """One rank skips a collective: within the timeout every waiting rank's error says which collective it
    waited in and that the skipping rank fell behind on that group."""
    pool = WorkerPool(3, timeout_s=60)
    try:
        start = time.monotonic()
        messages = pool.run(skip_a_collective, 3.0)
        elapsed = time.monotonic() - start
    finally:
        close_pools([pool])
    assert messages[2] == "skipped"
    for rank, message in enumerate(messages[:2]):
        assert f"rank {rank}: all_reduce #2 on group 'hang_test'" in message
        assert "rank 2: not waiting in any collective; 1 collectives issued on 'hang_test'" in message
        assert "rank(s) [2] fell behind on 'hang_test': they never issued all_reduce #2" in message
        assert "rank 0: waiting in all_reduce #2" in message and "rank 1: waiting in all_reduce #2" in message
    assert elapsed < 30


class _Payload:
    """Unpickling this runs code: it touches the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_whose_metadata_would_run_code_is_refused(tmp_path):
    """Replace a checkpoint's .metadata with a pickle that runs code (and fix up its manifest, as an
    attacker could): resuming refuses it, naming what it would have built, and the code never runs."""
    import hashlib
    import pickle

    run = ["--training.steps=2", "--checkpoint.every=2", f"--run.dir={tmp_path}"]
    assert run_cli(run).returncode == 0
    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    marker = tmp_path / "pwned"
    metadata = pickle.dumps(_Payload(str(marker)))
    (checkpoint / ".metadata").write_bytes(metadata)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest[".metadata"] = {"bytes": len(metadata), "sha256": hashlib.sha256(metadata).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    out = run_cli([*run, "--training.steps=3", "--checkpoint.resume=true"])
    assert out.returncode == 2 and "is not a meshtron checkpoint" in out.stderr
    assert "names io.open" in out.stderr and not marker.exists()
