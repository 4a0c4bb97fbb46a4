"""Ctrl-C on `meshtron train`: no traceback from any rank, one line that says where the run stopped and
how to go on, and exit status 130 (128 + SIGINT, what a shell reports for a process Ctrl-C ended).

  one process   the SIGINT raises KeyboardInterrupt in the step loop; train() ends the process group and
                says how many steps were complete (train.TrainingInterrupted); cmd_train prints the line
  --nproc N     the terminal sends SIGINT to the launcher and to every rank (one process group), and
                torch's launcher forwards it to the ranks once more: each rank leaves quietly, rank 0
                first leaving its count of complete steps in the launcher's error directory; the launcher
                prints the line once every rank is gone
  torchrun      each rank leaves quietly; rank 0 prints the line

The line names the newest complete checkpoint (a save cut short is a `.tmp` directory, never counted) and
the command that resumes from it, or, with none, what rerunning does.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from meshtron.config.schema import Config

EXIT_CODE = 130
STEPS_FILE = "interrupted.json"  # rank 0's complete steps, in the launcher's error directory


def resume_line(cfg: Config, completed: int | None, command: str) -> str:
    """What the user reads last: the step reached (`completed` steps done; None: unknown, or still
    starting), the newest complete checkpoint, and the command that goes on (`command`: how the run was
    launched, before `--config`)."""
    from meshtron.checkpoint.save_load import complete_checkpoints
    from meshtron.train.setup import checkpoint_root

    steps = cfg.training.steps
    if completed is None:
        where = "interrupted"
    elif completed >= steps:
        where = f"interrupted after the last step ({steps})"
    else:
        where = f"interrupted at step {completed + 1}"
    config = Path(cfg.run.dir) / "config.toml"  # the resolved config, written as the run started
    if not config.is_file():
        return f"{where}, before the run wrote anything; rerun the same command to start it"
    go_on = f"{command} --config {shlex.quote(str(config))} --checkpoint.resume=true"
    saved = complete_checkpoints(checkpoint_root(cfg))
    if saved:
        newest = saved[-1]
        return f"{where}; last complete checkpoint: step {newest.step} ({newest.path}); resume with: {go_on}"
    every = cfg.checkpoint.every
    due = f"the first was due at step {every}" if every else "checkpoint.every=0 saves none"
    return f"{where}; no checkpoint yet ({due}), so rerunning starts again from step 1: {go_on}"


def end_rank(cfg: Config, completed: int | None, errors: str | None) -> int:
    """A rank's end after Ctrl-C, quiet: under `--nproc` rank 0 leaves `completed` in the launcher's
    directory `errors` (the launcher prints the line); under torchrun (no `errors`) rank 0 prints it."""
    if int(os.environ.get("RANK", "0")) != 0:
        return EXIT_CODE
    if errors:
        Path(errors, STEPS_FILE).write_text(json.dumps({"completed": completed}))
    else:
        say(resume_line(cfg, completed, "torchrun ... -m meshtron train"))
    return EXIT_CODE


def end_launch(cfg: Config, world_size: int, errors: Path) -> int:
    """The launcher's end after Ctrl-C, its ranks gone: the line, with rank 0's count of complete steps."""
    completed = None
    if (errors / STEPS_FILE).is_file():
        completed = json.loads((errors / STEPS_FILE).read_text())["completed"]
    say(resume_line(cfg, completed, f"meshtron train --nproc {world_size}"))
    return EXIT_CODE


def say(line: str) -> None:
    print(f"meshtron: {line}", file=sys.stderr, flush=True)
