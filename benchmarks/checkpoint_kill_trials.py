"""Kill a training run at random moments while it checkpoints every step, many times; each time, the
newest complete checkpoint must load and the run resume from it.

A trial starts `meshtron train` (2 ranks, the demo model, a checkpoint after every step), waits until
the first checkpoint exists, then SIGKILLs the whole process group at a random moment within the next
few steps: mostly in the middle of a save, since saving takes about as long as a step here. It then
resumes the run for one more step with checkpoint.resume=true and requires that it finds an intact
checkpoint, says which step it resumed at, and trains on. Results go to RESULTS.md.

    python benchmarks/checkpoint_kill_trials.py --trials 20
    python benchmarks/checkpoint_kill_trials.py --trials 20 --async   # checkpoint.async = true

With --async the kill mostly lands while a save is being written in the background (training goes on
meanwhile), which must leave the previous checkpoint usable just the same.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reporting import RESULTS, write_section

COMMON = [
    "--config", "configs/demo.toml", "--nproc=2", "--training.micro_batch=4", "--training.seq_len=64",
    "--training.global_batch=8", "--checkpoint.every=1", "--checkpoint.keep=2", "--run.plot=false",
]  # fmt: skip


def meshtron(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", *COMMON, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, **kwargs,
    )  # fmt: skip


def kill_run(run_dir: Path) -> None:
    """SIGKILL the launcher and every rank of the run (the ranks are not in the launcher's process group,
    so they are found by the run directory on their command line)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def trial(run_dir: Path, rng: random.Random, extra: list[str]) -> dict:
    """One kill and resume; what was on disk and whether the resume worked."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run = meshtron(["--training.steps=200", f"--run.dir={run_dir}", *extra])
    root = run_dir / "checkpoints"
    deadline = time.monotonic() + 300
    while not any(root.glob("step-*[0-9]")) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 3.0))
    kill_run(run_dir)
    run.wait()
    time.sleep(0.5)
    partial = sorted(p.name for p in root.glob("*.tmp"))
    complete = sorted(p.name for p in root.glob("step-*") if not p.name.endswith(".tmp"))
    newest = int(complete[-1].split("-")[1]) if complete else 0
    resume = meshtron(
        [f"--training.steps={newest + 1}", "--checkpoint.resume=true", f"--run.dir={run_dir}", *extra]
    )
    out, _ = resume.communicate(timeout=600)
    resumed = re.search(r"resumed from .*step-(\d+) at step (\d+)", out)
    return {
        "complete": complete,
        "partial": partial,
        "resumed_at": int(resumed.group(2)) if resumed else None,
        "ok": resume.returncode == 0 and resumed is not None and int(resumed.group(2)) == newest,
        "tail": out[-400:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--async", dest="async_save", action="store_true", help="checkpoint.async = true")
    args = parser.parse_args()
    extra = ["--checkpoint.async=true"] if args.async_save else []
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.trials):
            result = trial(Path(tmp) / "run", rng, extra)
            results.append(result)
            print(f"trial {index}: {result['complete']} complete, {result['partial']} partial -> "
                  f"{'resumed at step ' + str(result['resumed_at']) if result['ok'] else 'FAILED'}", flush=True)  # fmt: skip
            if not result["ok"]:
                print(result["tail"])
    mid_save = sum(bool(r["partial"]) for r in results)
    ok = sum(r["ok"] for r in results)
    flag, how = (" --async", "asynchronously (written in the background) ") if args.async_save else ("", "")
    body = (
        f"{args.trials} trials (`python benchmarks/checkpoint_kill_trials.py --trials {args.trials}{flag}`): 2 "
        f"ranks checkpointing {how}after every step, SIGKILLed at a random moment; "
        f"{mid_save} of them died in the middle of a save (a `.tmp` directory left behind). "
        f"**{ok} of {args.trials}** resumed from the newest complete checkpoint and trained on."
    )
    if args.out != "-":
        title = "## Checkpoints under random kills" + (" (asynchronous saves)" if args.async_save else "")
        write_section(Path(args.out), title, "checkpoint_kill_trials.py" + flag, body)
    print(body)
    return 0 if ok == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
