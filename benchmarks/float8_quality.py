"""Benchmark: does float8 training track bf16? The demo trained in bf16 and in float8 (both recipes).

`meshtron train --config configs/demo.toml` for 200 steps on 2 local ranks (DDP), once with
`training.dtype = "bf16"` and once with `"fp8"` per recipe, from the same seed and data: the loss curves
side by side, the float8 runs' largest relative distance from the bf16 loss over steps 21-200 (the
first steps move too fast to compare point by point) and of the mean over the last 20 steps, which the
issue asks to stay within 2%. Speed is not the point on a CPU (float8 is emulated there:
models/float8.py); benchmarks/gpu_check.py times it on a GPU.

    python benchmarks/float8_quality.py                 # the table into RESULTS.md, the plot into docs/img
    python benchmarks/float8_quality.py --steps 30 --out -
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reporting import RESULTS, cpu_model, plot_losses, table, write_section

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## Float8 training against bf16 (the demo, CPU, emulated float8)"
RUNS = {"bf16": ["--training.dtype=bf16"], "fp8 tensorwise": ["--training.dtype=fp8"],
        "fp8 rowwise": ["--training.dtype=fp8", "--training.fp8_recipe=rowwise"]}  # fmt: skip


def losses(flags: list[str], steps: int, run_dir: Path) -> list[float]:
    cmd = [sys.executable, "-m", "meshtron", "train", "--config", "configs/demo.toml", "--nproc=2",
           f"--training.steps={steps}", "--checkpoint.every=0", "--run.sample_tokens=0", "--run.plot=false",
           f"--run.dir={run_dir}", *flags]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(flags)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {
            name: losses(flags, args.steps, Path(tmp) / name.replace(" ", "-"))
            for name, flags in RUNS.items()
        }
    bf16, skip, tail = curves["bf16"], min(20, args.steps // 4), min(20, args.steps)
    rows = []
    for name, values in curves.items():
        worst = max(abs(v - b) / b for v, b in zip(values[skip:], bf16[skip:], strict=True))
        last = statistics.mean(values[-tail:]) / statistics.mean(bf16[-tail:]) - 1
        rows.append(
            [name, f"{values[0]:.4f}", f"{values[-1]:.4f}", f"{100 * worst:.2f}%", f"{100 * last:+.2f}%"]
        )
    header = (f"run | loss at step 1 | loss at step {args.steps} | largest distance from bf16, steps {skip + 1}-"
              f"{args.steps} | mean of the last {tail} steps vs bf16")  # fmt: skip
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {cpu_model()}; took {time.perf_counter() - started:.0f} s",
        "`meshtron train --config configs/demo.toml --nproc=2` (DDP), the same seed and data in every run",
        f"reproduce: `python benchmarks/float8_quality.py --steps {args.steps}`",
    ]
    body = "\n".join(f"- {f}" for f in facts) + "\n\n" + "\n".join(table(header, rows)) + "\n"
    print(body)
    if args.out != "-":
        write_section(Path(args.out), TITLE, "float8_quality.py", body)
        plot_losses(curves, ROOT / "docs" / "img" / "float8-vs-bf16.png", "the demo in bf16 and in float8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
