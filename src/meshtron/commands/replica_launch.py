"""`meshtron train --nproc N` with fault_tolerance.enabled: one launcher per replica group, one lighthouse.

  lighthouse      torchft's, in this process: forms each step's quorum of the live replica groups
  store           a TCPStore in this process: the groups' start (all ready before the first step) and
                  the newest committed step (what a group that restarts alone must be able to reach)
  replica group g torch's elastic launcher (torchrun) in a child process, N / dp_replicate ranks, with
                  MESHTRON_REPLICA_GROUP=g; it restarts its own ranks (up to --max-restarts times) when
                  one dies, and the other groups never notice more than a step retried without it

The job ends when every group has ended. A group that fails for good (its restarts spent, or no live
group left to heal from) ends the others too, and its first rank's message is the job's.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from meshtron.config.schema import Config

RESTARTS = 3  # each group's restarts when --max-restarts is not given: a group must be able to come back


def launch_replica_groups(
    nproc: int, max_restarts: int, rank_argv: Sequence[str], argv: Sequence[str], cfg: Config
) -> int:
    """Start cfg.parallel.dp_replicate replica groups of nproc / dp_replicate local ranks each, running
    `meshtron <rank_argv>`; returns the job's exit status. `argv`: what the user typed."""
    from meshtron.comm.replica_groups import FATAL_KEY, launcher_store, start_lighthouse
    from meshtron.commands import interrupt
    from meshtron.commands.rank_errors import ERROR_DIR, first_rank_error
    from meshtron.train.fault_tolerance import GROUP_ENV, LIGHTHOUSE_ENV, STORE_ENV

    groups = cfg.parallel.dp_replicate
    lighthouse, store = start_lighthouse(groups), launcher_store()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))),
        "MESHTRON_COMMAND": shlex.join(["meshtron", *argv]),
        LIGHTHOUSE_ENV: lighthouse.address(),
        STORE_ENV: f"localhost:{store.port}",
    }
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc // groups}",
        f"--max-restarts={max_restarts or RESTARTS}",
        "--monitor-interval=0.5",
        "--module",
        "meshtron",
        *rank_argv,
    ]
    with tempfile.TemporaryDirectory(prefix="meshtron-errors-") as errors:
        dirs = [Path(errors) / f"group-{g}" for g in range(groups)]
        procs = []
        for g, folder in enumerate(dirs):
            folder.mkdir()
            procs.append(subprocess.Popen(launcher, env={**env, GROUP_ENV: str(g), ERROR_DIR: str(folder)}))
        try:
            failed = _wait(procs, store, FATAL_KEY)
        except KeyboardInterrupt:  # the ranks had it too (one process group); the launchers once more
            for p in procs:
                p.send_signal(signal.SIGINT)
            for p in procs:
                p.wait()
            newest = max(dirs, key=lambda d: _completed(d / interrupt.STEPS_FILE))
            return interrupt.end_launch(cfg, nproc, newest)
        finally:
            lighthouse.shutdown()
        if failed is None:
            return 0
        if store.check([FATAL_KEY]):
            message = store.get(FATAL_KEY).decode()
        else:
            message = first_rank_error(dirs[failed], RuntimeError("its ranks exited abnormally"))
        print(f"meshtron: training failed: replica group {failed}, {message}", file=sys.stderr)
        return 1


def _completed(steps_file: Path) -> int:
    """The complete steps a group's rank 0 left when Ctrl-C ended it (-1: none)."""
    return json.loads(steps_file.read_text())["completed"] if steps_file.is_file() else -1


def _wait(procs: list[subprocess.Popen], store: object, fatal: str) -> int | None:
    """Wait for every group's launcher; on the first that fails (or a group's fatal message in the
    store), stop the others and return its index; None when all ended well."""
    while True:
        codes = [p.poll() for p in procs]
        bad = next((g for g, code in enumerate(codes) if code not in (None, 0)), None)
        if bad is None and store.check([fatal]):  # type: ignore[attr-defined]
            bad = int(store.get(f"{fatal}-group"))  # type: ignore[attr-defined]
        if bad is not None:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            return bad
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)
