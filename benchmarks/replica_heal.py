"""One rank killed mid-run, three ways, on the same job: what each costs in wall time and in samples.

The job: the demo model, 4 ranks as dp_replicate 2 x dp_shard 2, a fixed number of steps. Rank 3 dies by
SIGKILL as step KILL begins (MESHTRON_KILL_RANK).

  uninterrupted          the run with fault_tolerance.enabled and no failure: the reference wall time
  replica groups heal    fault_tolerance.enabled: group 1 restarts and heals from group 0 over the network;
                         group 0 never stops, and the steps group 1 missed lose its share of their samples
  checkpoint-restart     the same layout without fault tolerance, a checkpoint every EVERY steps and
                         --max-restarts=1: every rank restarts and the steps since the checkpoint are
                         computed again

Each run is timed from launch to exit; the heal's own seconds are what the healed group prints.
Results go to RESULTS.md.

    python benchmarks/replica_heal.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reporting import RESULTS, table, write_section

STEPS, KILL, EVERY = 80, 14, 8
COMMON = [
    "--config", "configs/demo.toml", "--nproc=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
    "--training.micro_batch=2", "--training.seq_len=64", "--training.global_batch=8", f"--training.steps={STEPS}",
    "--run.plot=false", "--run.sample_tokens=0", "--run.log_every=10",
]  # fmt: skip


def run(run_dir: Path, extra: list[str], kill: bool) -> dict:
    """One launch; its wall time, output and metrics rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"MESHTRON_KILL_RANK": f"3:{KILL}"} if kill else {})}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", *COMMON, *extra, f"--run.dir={run_dir}"],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall": wall, "stdout": out.stdout, "rows": rows}


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ft = ["--fault_tolerance.enabled=true", "--checkpoint.every=0"]
        plain = run(root / "plain", ft, kill=False)
        healed = run(root / "healed", ft, kill=True)
        restarted = run(root / "restarted", [f"--checkpoint.every={EVERY}", "--max-restarts=1"], kill=True)
    assert [r["step"] for r in healed["rows"]] == list(range(1, STEPS + 1))
    assert [r["step"] for r in restarted["rows"]] == list(range(1, STEPS + 1))
    alone = [r["step"] for r in healed["rows"] if r["replicas"]["live"] == 1]
    if healed["rows"][-1]["replicas"]["live"] != 2:
        raise SystemExit("group 1 did not rejoin before the last step: raise STEPS")
    heal_s = re.search(r"over the network in ([0-9.]+) s", healed["stdout"])
    step_s = sorted(r["step_time_s"] for r in plain["rows"])[STEPS // 2]
    recomputed = KILL - 1 - (KILL - 1) // EVERY * EVERY
    rows = [
        ["uninterrupted (fault tolerance on)", f"{plain['wall']:.1f}", "-", "0", "0"],
        [
            "replica groups heal",
            f"{healed['wall']:.1f}",
            f"{healed['wall'] - plain['wall']:+.1f}",
            "0",
            f"{len(alone)} steps x group 1's half of the batch (steps {alone[0]}-{alone[-1]})",
        ],
        [
            f"checkpoint-restart (every {EVERY} steps)",
            f"{restarted['wall']:.1f}",
            f"{restarted['wall'] - plain['wall']:+.1f}",
            f"{recomputed} (steps {KILL - recomputed}-{KILL - 1})",
            "0",
        ],
    ]
    body = "\n".join(
        [
            f"- job: the demo model, 4 gloo ranks on this CPU as dp_replicate 2 x dp_shard 2, {STEPS} steps of "
            f"8 x 64 tokens; rank 3 SIGKILLed as step {KILL} begins",
            f"- median step {step_s:.2f} s uninterrupted",
            f"- the healed group's quorum, with the state transfer over HTTP: {heal_s.group(1) if heal_s else '?'} s",
            "- under healing the live group loses the failed attempt of the step and the wait for a quorum "
            "without the dead group (the lighthouse drops it 1 s after its last heartbeat)",
            "",
            *table(
                "run | wall s | vs uninterrupted | steps computed again | samples not trained",
                rows,
            ),
            "",
            "The live group never stops under healing: the wall time lost is about the failed step's retry "
            "(on this 2-core machine the live group even runs faster while it is alone, its share of the cores "
            "doubled, which the wall time above includes). "
            "Checkpoint-restart stops every rank, starts them again (the processes, the process groups, the "
            "checkpoint read) and computes the steps since the checkpoint again; it loses no sample.",
        ]
    )
    write_section(RESULTS, "## Replica groups heal: one rank killed, three ways", "replica_heal.py", body)
    print(body)


if __name__ == "__main__":
    main()
