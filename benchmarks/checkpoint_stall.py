"""How long a checkpoint holds training up: synchronous saves against asynchronous ones
(checkpoint.async = true), on a model whose checkpoint takes seconds to write.

Two `meshtron train` runs of the same job (2 ranks, ZeRO-3, a 111M-parameter Llama: 1.3 GB of
parameters and AdamW moments, a checkpoint every 2 steps), one saving synchronously and one
asynchronously. Their losses must be identical (saving changes nothing) before any time is compared.
The stall per save is what the trainer measures around `save` (summary.json `checkpoint_stall_s`): the
whole write, manifest and rename when synchronous; the staging copy into host memory when
asynchronous. The background write shares this machine's 2 cores with training, so the steps it
overlaps run slower: the table shows the median step time and the whole run's wall time too.

    python benchmarks/checkpoint_stall.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from reporting import RESULTS, write_section

MODEL = [
    "--model.dim=1024", "--model.n_layers=8", "--model.n_heads=16", "--model.ffn_dim=2816",
    "--model.vocab_size=4096", "--data.tokenizer_vocab=4096",
]  # fmt: skip
JOB = [
    "--config", "configs/demo.toml", "--nproc=2", "--training.seq_len=64", "--training.global_batch=4",
    "--training.micro_batch=2", "--training.steps=8", "--checkpoint.every=2", "--checkpoint.keep=1",
    "--run.plot=false", "--run.sample_tokens=0",
]  # fmt: skip


def run(run_dir: Path, async_save: bool) -> dict:
    """One run; its metrics rows and summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*JOB, *MODEL, f"--run.dir={run_dir}", f"--checkpoint.async={str(async_save).lower()}"]
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"meshtron train failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "rows": [r for r in rows if "loss" in r],
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync, background = run(Path(tmp) / "sync", False), run(Path(tmp) / "async", True)
    losses = [[r["loss"] for r in x["rows"]] for x in (sync, background)]
    if losses[0] != losses[1]:
        raise SystemExit(f"the runs differ: sync {losses[0]} against async {losses[1]}")
    lines = [
        "| saves | stall per save, median | max | median step time | run wall time |",
        "|---|---|---|---|---|",
    ]
    stalls = []
    for name, x in (("synchronous", sync), ("asynchronous", background)):
        stall, s = x["summary"]["checkpoint_stall_s"], x["summary"]
        step = statistics.median(r["step_time_s"] for r in x["rows"])
        stalls.append(stall["median"])
        lines.append(
            f"| {name}: {stall['saves']} | {stall['median']:.2f} s | {stall['max']:.2f} s | {step:.2f} s | "
            f"{s['wall_time_s']:.1f} s |"
        )
    body = "\n".join(
        [
            "2 ranks (gloo, 1 thread each), ZeRO-3, a 111M-parameter Llama (dim 1024, 8 layers): 1.3 GB of "
            "state, a checkpoint every 2 of 8 steps (`python benchmarks/checkpoint_stall.py`). Losses "
            "identical in both runs.",
            "",
            *lines,
            "",
            f"Training stalls {stalls[0] / stalls[1]:.0f}x less per save with `checkpoint.async = true`; the "
            "write then runs beside the steps (here on the same 2 cores, which slows the steps it overlaps).",
        ]
    )
    if args.out != "-":
        write_section(
            Path(args.out), "## Checkpoint stalls: synchronous and asynchronous", "checkpoint_stall.py", body
        )
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
