"""Benchmark: the layout `meshtron train --parallel.auto=true` picks, against the named layouts, on this
CPU with 4 gloo ranks, measured in the same run.

Every round runs the demo (configs/demo.toml, which sets training.micro_batch = 4: held by the auto
pick) under each named layout of benchmarks/planner_cpu.py (DDP, ZeRO-3, tp, pp, pp 4, cp), then with
`--parallel.auto=true`, each as a real `meshtron train --nproc 4` run of `--steps` steps; a run's step
time is the median `step_time_s` of rank 0's metrics after `--warmup` steps. Before any time is
compared, every run's first loss must equal the DDP run's (the same model, seed and batches under any
layout). Reported per round: the auto pick, its measured step, the fastest named layout's, and their
ratio (the goal: within 10%). The table goes to RESULTS.md ("## Automatic layout on this CPU").

    python benchmarks/auto_layout.py [--steps 16] [--warmup 4] [--rounds 2] [--out -]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from planner_cpu import CASES, RANKS, Case, case_config, run_case
from reporting import RESULTS, cpu_model, publish, table

from meshtron.plan.layout import Layout

TITLE = "## Automatic layout on this CPU"
NAMED = ("ddp", "zero3", "tp", "pp", "pp4", "cp")
GOAL = 0.10
LOSS_RTOL = 1e-4


def auto_run(steps: int, run_dir: Path) -> tuple[list[dict], str]:
    """`meshtron train --nproc 4 --parallel.auto=true` on the demo: its metrics rows and its pick."""
    base = [f"--training.steps={steps}", "--run.plot=false", "--run.log_every=1", "--parallel.auto=true"]
    rows, _ = run_case(Case("auto", "configs/demo.toml", Layout()), base, steps, run_dir)
    chosen = json.loads((run_dir / "environment.json").read_text())["auto_layout"]["chosen"]
    return rows, chosen


def one_round(steps: int, warmup: int, tmp: Path, index: int) -> dict:
    """Every named layout, then the auto pick: (name -> (first loss, median step)), and the pick."""
    named = {}
    for case in (c for c in CASES if c.name in NAMED):
        _, flags = case_config(case, steps)
        rows, _ = run_case(case, flags, steps, tmp / f"{case.name}-{index}")
        named[case.name] = (rows[0]["loss"], statistics.median(r["step_time_s"] for r in rows[warmup:]))
        print(f"round {index}: {case.name} {1e3 * named[case.name][1]:.0f} ms", flush=True)
    rows, chosen = auto_run(steps, tmp / f"auto-{index}")
    auto = (rows[0]["loss"], statistics.median(r["step_time_s"] for r in rows[warmup:]))
    print(f"round {index}: auto ({chosen}) {1e3 * auto[1]:.0f} ms", flush=True)
    reference = named["ddp"][0]
    for name, (loss, _) in [*named.items(), ("auto", auto)]:
        if abs(loss - reference) > LOSS_RTOL * abs(reference):
            sys.exit(f"{name}'s first loss {loss} differs from DDP's {reference}: nothing compared")
    return {"named": named, "auto": auto, "chosen": chosen}


def report(rounds: list[dict], args: argparse.Namespace, took: float) -> str:
    rows, ratios = [], []
    for i, r in enumerate(rounds):
        best = min(r["named"], key=lambda n: r["named"][n][1])
        ratio = r["auto"][1] / r["named"][best][1]
        ratios.append(ratio)
        named = ", ".join(f"{n} {1e3 * s:.0f}" for n, (_, s) in r["named"].items())
        rows.append([f"{i + 1}", f"`{r['chosen']}`", f"{1e3 * r['auto'][1]:.0f}", f"{best} {1e3 * r['named'][best][1]:.0f}",
                     f"{ratio:.2f}", "yes" if ratio <= 1 + GOAL else "**no**", named])  # fmt: skip
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; run took {took:.0f} s",
        f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other jobs); {RANKS} ranks",
        f"runs: `meshtron train --config configs/demo.toml --nproc {RANKS}`, {args.steps} steps each; a step "
        f"time is the median `step_time_s` of the last {args.steps - args.warmup}; every run's first loss "
        f"equal to DDP's within {LOSS_RTOL:g} (checked before comparing)",
        f"reproduce: `python benchmarks/auto_layout.py{''.join(' ' + a for a in sys.argv[1:])}`",
        f"auto / fastest named layout: {', '.join(f'{x:.2f}' for x in ratios)} (goal: at most {1 + GOAL:.2f})",
    ]
    header = "round | auto's pick | auto step ms | fastest named, ms | auto / fastest | within 10% | every named layout, ms"
    blocks = [
        [f"- {f}" for f in facts],
        table(header, rows, "The auto pick against the named layouts, same round:"),
    ]
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every layout and the auto pick")
    parser.add_argument("--out", default=str(RESULTS), help="results file; '-' writes nothing")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(args.steps, args.warmup, Path(tmp), i + 1) for i in range(args.rounds)]
    body = report(rounds, args, time.perf_counter() - started)
    publish(body, args.out, TITLE, Path(__file__).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
