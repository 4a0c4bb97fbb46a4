"""Issue 45.6: Ctrl-C on `meshtron train` (SIGINT to its process group, as a terminal sends it) ends every
rank without a traceback and with one line: the step reached, the newest complete checkpoint, and the
command that resumes; exit status 130."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from meshtron.commands.interrupt import resume_line
from meshtron.rules.checks import load_config
from meshtron.testing.tiny import TINY

ROOT = Path(__file__).resolve().parents[1]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def interrupted_run(run_dir: Path, *launch: str) -> tuple[subprocess.CompletedProcess, int]:
    """A long tiny run saving every 2 steps, sent SIGINT once it has logged 3 steps; (its output, the
    rows it had logged by the end)."""
    args = ["train", "--config", "configs/demo.toml", *TINY, "--training.steps=500", "--checkpoint.every=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron", *args, *launch, f"--run.dir={run_dir}"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job, and
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C not ignored
    )
    deadline = time.monotonic() + 300
    while len(rows(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), len(rows(run_dir))


def check_the_line(out: subprocess.CompletedProcess, logged: int, run_dir: Path, command: str) -> list[str]:
    """The interrupt's line is the last, names the newest complete checkpoint; returns the command."""
    assert out.returncode == 130, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    line = out.stderr.rstrip("\n").splitlines()[-1]
    newest = max((run_dir / "checkpoints").glob("step-*[0-9]"))
    found = re.fullmatch(
        rf"meshtron: interrupted at step (\d+); last complete checkpoint: step (\d+) \({re.escape(str(newest))}\); "
        rf"resume with: ({re.escape(command)} --config {re.escape(str(run_dir / 'config.toml'))} "
        r"--checkpoint.resume=true)",
        line,
    )
    assert found, line
    at, saved = int(found.group(1)), int(found.group(2))
    assert saved == int(newest.name.removeprefix("step-")) and saved % 2 == 0 and saved < at
    assert logged - 1 <= at - 1 <= logged  # the steps complete (a row may be out for the one in progress)
    return shlex.split(found.group(3))


def test_ctrl_c_on_nproc_2_ends_with_one_line_and_no_traceback(tmp_path):
    out, logged = interrupted_run(tmp_path, "--nproc", "2")
    check_the_line(out, logged, tmp_path, "meshtron train --nproc 2")
    assert out.stderr.count("interrupted at step") == 1  # once, from the launcher: the ranks stay quiet


def test_ctrl_c_on_one_process_ends_with_one_line_and_its_command_resumes(tmp_path):
    out, logged = interrupted_run(tmp_path)
    command = check_the_line(out, logged, tmp_path, "meshtron train")
    saved = int(max((tmp_path / "checkpoints").glob("step-*[0-9]")).name.removeprefix("step-"))
    resumed = subprocess.run(
        [sys.executable, "-m", *command[:1], *command[1:], f"--training.steps={saved + 1}"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints'}" in resumed.stdout
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, saved + 2))


@pytest.mark.parametrize("every", [5, 0])
def test_the_line_without_a_checkpoint_says_what_rerunning_does(tmp_path, every):
    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path}", f"--checkpoint.every={every}"])
    assert resume_line(cfg, None, "meshtron train") == (
        "interrupted, before the run wrote anything; rerun the same command to start it"
    )
    (tmp_path / "config.toml").write_text("")
    due = "the first was due at step 5" if every else "checkpoint.every=0 saves none"
    assert resume_line(cfg, 2, "meshtron train") == (
        f"interrupted at step 3; no checkpoint yet ({due}), so rerunning starts again from step 1: "
        f"meshtron train --config {tmp_path / 'config.toml'} --checkpoint.resume=true"
    )
    (tmp_path / "checkpoints" / "step-00000002.tmp").mkdir(parents=True)  # a save cut short: not counted
    assert "no checkpoint yet" in resume_line(cfg, None, "meshtron train")
    assert resume_line(cfg, None, "meshtron train").startswith("interrupted; ")
    assert resume_line(cfg, cfg.training.steps, "x").startswith(
        f"interrupted after the last step ({cfg.training.steps})"
    )


def test_ctrl_c_is_found_however_it_surfaced():
    """A checkpoint save wraps each rank's KeyboardInterrupt (torch.distributed.checkpoint catches every
    exception); one raised while handling it chains it."""
    from torch.distributed.checkpoint import CheckpointException

    from meshtron.train.trainer import by_ctrl_c

    wrapped = CheckpointException("save failed", {0: (KeyboardInterrupt(), traceback.StackSummary())})
    assert by_ctrl_c(wrapped) and by_ctrl_c(KeyboardInterrupt())
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Connection closed by peer") from None
    except RuntimeError as err:
        assert by_ctrl_c(err)  # its __context__, though `from None` hides it from the traceback
    assert not by_ctrl_c(RuntimeError("a real failure"))
    assert not by_ctrl_c(CheckpointException("save failed", {0: (OSError(), traceback.StackSummary())}))
