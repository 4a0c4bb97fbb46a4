"""Benchmark: Muon against AdamW at equal tokens, each at its best learning rate of a small sweep.

`meshtron train --config configs/demo.toml` (the ~5M-parameter Llama, or `--model larger`, one rank) for the same steps,
seed and data with `training.optimizer = "adamw"` and `"muon"` (Muon's default lr rule,
"match_rms_adamw", so one lr drives both groups), each at three learning rates; 5% of the tokens held
out and evaluated after the last step. The table gives every run's final training loss (mean of the last
20 steps) and validation loss; the plot, the best run of each optimizer's training-loss curve.

    python benchmarks/muon_quality.py                  # the table into RESULTS.md, the plot into docs/img
    python benchmarks/muon_quality.py --model larger --steps 150 --lrs 1e-3,3e-3
    python benchmarks/muon_quality.py --steps 30 --lrs 2e-3 --out -
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
OPTIMIZERS = ("adamw", "muon")
# The demo's model, and one with 3x its matrix parameters (dim 384, 6 layers: ~13M parameters).
MODELS = {
    "demo": [],
    "larger": ["--model.dim=384", "--model.n_layers=6", "--model.n_heads=6", "--model.n_kv_heads=2",
               "--model.ffn_dim=1024"],
}  # fmt: skip


def run(optimizer: str, lr: float, steps: int, run_dir: Path, model: list[str]) -> tuple[list[float], float]:
    """(training losses, the validation loss after the last step) of one run."""
    cmd = [sys.executable, "-m", "meshtron", "train", "--config", "configs/demo.toml", *model, f"--training.steps={steps}",
           f"--training.warmup_steps={max(1, steps // 10)}", f"--training.optimizer={optimizer}",
           f"--training.lr={lr}", "--data.val_fraction=0.05", f"--training.eval_every={steps}",
           "--checkpoint.every=0", "--run.sample_tokens=0", "--run.plot=false", f"--run.dir={run_dir}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{optimizer} lr {lr} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and "step" in r]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return losses, val[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", default="1e-3,2e-3,4e-3", help="comma-separated learning rates, for both")
    parser.add_argument("--model", choices=list(MODELS), default="demo")
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")]
    started = time.perf_counter()
    results: dict[tuple[str, float], tuple[list[float], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer in OPTIMIZERS:
            for lr in lrs:
                where = Path(tmp) / f"{optimizer}-{lr}"
                results[optimizer, lr] = run(optimizer, lr, args.steps, where, MODELS[args.model])
                print(optimizer, lr, f"val {results[optimizer, lr][1]:.4f}", flush=True)
    tail = min(20, args.steps)
    rows, best = [], {}
    for (optimizer, lr), (losses, val) in results.items():
        rows.append([optimizer, f"{lr:g}", f"{statistics.mean(losses[-tail:]):.4f}", f"{val:.4f}"])
        if optimizer not in best or val < results[optimizer, best[optimizer]][1]:
            best[optimizer] = lr
    header = f"optimizer | lr | training loss, mean of the last {tail} steps | validation loss after step {args.steps}"
    verdict = {o: results[o, best[o]][1] for o in OPTIMIZERS}
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {cpu_model()}; took {time.perf_counter() - started:.0f} s",
        f"`meshtron train --config configs/demo.toml {' '.join(MODELS[args.model])}` on one rank, {args.steps} "
        "steps of 16 x 128 tokens, the same seed and data in every run, 5% of the tokens held out",
        f"best: AdamW lr {best['adamw']:g} (validation {verdict['adamw']:.4f}), Muon lr {best['muon']:g} "
        f"(validation {verdict['muon']:.4f}): Muon {100 * (verdict['muon'] / verdict['adamw'] - 1):+.1f}%",
        f"reproduce: `python benchmarks/muon_quality.py --model {args.model} --steps {args.steps} --lrs {args.lrs}`",
    ]
    body = "\n".join(f"- {f}" for f in facts) + "\n\n" + "\n".join(table(header, rows)) + "\n"
    print(body)
    if args.out != "-":
        title = f"## Muon against AdamW ({args.model}: equal tokens, each at its best learning rate)"
        write_section(Path(args.out), title, f"muon_quality.py --model {args.model}", body)
        curves = {f"{o} (lr {best[o]:g})": results[o, best[o]][0] for o in OPTIMIZERS}
        path = ROOT / "docs" / "img" / f"muon-vs-adamw-{args.model}.png"
        plot_losses(curves, path, f"{path.stem}: each at its best lr")
    return 0


if __name__ == "__main__":
    sys.exit(main())
