"""The planner's step time against measured training runs, on this CPU with 4 gloo ranks.

For each layout (DDP, ZeRO-3, tensor, pipeline, context and expert parallel) of the demo model (and of
tiny-moe for expert parallel): the planner's prediction, `estimate(layout.apply(cfg), cpu_cluster(4))`,
and a real `meshtron train --nproc 4` run of the same config for a few steps, whose steady-state step
time is the median `step_time_s` of rank 0's metrics.jsonl after the warm-up steps. Other jobs on a
shared machine come and go, so the machine is probed (hardware_probe, afresh) before every run and
after the last, and each prediction uses the mean of the two probes around its run; the CPU other jobs
took during each run is recorded beside it. Every case runs `--rounds` times, one round after another,
to show the spread between runs. The table goes to RESULTS.md ("## Planner on this CPU").

    python benchmarks/planner_cpu.py [--steps 20] [--warmup 4] [--rounds 2] [--only ddp,tp] [--out -]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from reporting import RESULTS, cpu_model, publish, quantile, table

from meshtron.config.schema import Config
from meshtron.plan.estimate import Estimate, estimate
from meshtron.plan.layout import Layout
from meshtron.probe.hardware import Measurement, cluster_from, launcher_threads, probe
from meshtron.rules.checks import check, load_config

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4
GOAL = 0.25  # issue 13: predicted step time within 25% of measured
TITLE = "## Planner on this CPU"


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    layout: Layout
    overrides: tuple[str, ...] = ()  # model or training changes beyond the layout


DEMO_MOE = ("--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=344")
CASES = (
    Case("ddp", "configs/demo.toml", Layout(dp_replicate=4, micro_batch=4)),
    Case("zero3", "configs/demo.toml", Layout(dp_shard=4, zero=3, micro_batch=4)),
    Case("tp", "configs/demo.toml", Layout(tp=2, dp_replicate=2, micro_batch=4)),
    Case("pp", "configs/demo.toml", Layout(pp=2, dp_replicate=2, pp_schedule="1f1b", micro_batch=2)),
    Case("pp4", "configs/demo.toml", Layout(pp=4, pp_schedule="1f1b", micro_batch=2)),
    Case("cp", "configs/demo.toml", Layout(cp=2, dp_replicate=2, micro_batch=4)),
    # The demo with 4 experts of half its FFN width, top-2 (the same active FFN per token), and tiny-moe.
    Case("ep", "configs/demo.toml", Layout(ep=4, dp_shard=4, zero=1, micro_batch=4), DEMO_MOE),
    Case("ep_tiny", "configs/tiny-moe.toml", Layout(ep=4, dp_shard=4, zero=1, micro_batch=4)),
)


def layout_flags(layout: Layout) -> list[str]:
    """The `meshtron train` flags of a layout (what Layout.apply sets)."""
    p = {k: getattr(layout, k) for k in ("tp", "sp", "cp", "cp_impl", "pp", "vpp", "pp_schedule", "ep")}
    p |= {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "zero": layout.zero}
    flags = [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in p.items()]
    return [
        *flags,
        f"--training.micro_batch={layout.micro_batch}",
        f"--training.recompute={layout.recompute}",
    ]


def case_config(case: Case, steps: int) -> tuple[Config, list[str]]:
    """The planned config and the flags that make `meshtron train` run exactly it."""
    base = [*case.overrides, f"--training.steps={steps}", "--run.plot=false", "--run.log_every=1"]
    planned = case.layout.apply(load_config(ROOT / case.config, base))
    flags = [*base, *layout_flags(case.layout)]
    ran = load_config(ROOT / case.config, flags)
    if (ran.parallel, ran.training) != (planned.parallel, planned.training):
        raise SystemExit(f"{case.name}: the run's flags do not give the planned config")
    check(planned, RANKS)
    return planned, flags


def busy_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds every process of the machine used, CPU seconds of our finished children
    and theirs): from /proc/stat and getrusage, to tell how much CPU other jobs took meanwhile."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    ticks = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), ticks, children.ru_utime + children.ru_stime


def others_cores(before: tuple[float, float, float]) -> float:
    """Cores other jobs kept busy on average since `before` (of busy_seconds)."""
    after = busy_seconds()
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def run_case(case: Case, flags: list[str], steps: int, run_dir: Path) -> tuple[list[dict], float]:
    """Train the case on RANKS local ranks: every step's metrics row (rank 0's metrics.jsonl), and
    the cores other jobs took meanwhile."""
    cmd = [sys.executable, "-m", "meshtron", "train", "--config", str(ROOT / case.config)]
    cmd += [f"--nproc={RANKS}", *flags, f"--run.dir={run_dir}"]
    before = busy_seconds()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if out.returncode != 0:
        # A rank that dies after the last step (at exit) leaves every step timed: keep them, and say so.
        print(f"{case.name}: exit status {out.returncode} after {len(rows)} steps:\n{out.stderr[-1500:]}")
        if len(rows) < steps:
            raise SystemExit(f"{case.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return rows, others_cores(before)


@dataclass
class Outcome:
    case: Case
    cfg: Config
    predicted: Estimate
    probe: Measurement  # the machine the prediction assumes: the probes around the run
    steps: list[float] = field(default_factory=list)  # measured, after warm-up
    imbalance: float | None = None  # MoE: median over those steps of the worst layer's max/mean load
    others: float | None = None  # cores other jobs on the machine kept busy during the run
    balanced: Estimate | None = (
        None  # MoE: the prediction at balanced routing (`predicted` is at `imbalance`)
    )

    @property
    def measured(self) -> float:
        return statistics.median(self.steps)

    @property
    def error(self) -> float:
        return self.predicted.step_time_s / self.measured - 1.0

    def row(self) -> list[str]:
        p, t = self.predicted, self.predicted.time
        parts = " / ".join(f"{k} {1e3 * v:.0f}" for k, v in t.items() if v >= 5e-4)
        spread = f"{1e3 * quantile(self.steps, 0.1):.0f}-{1e3 * quantile(self.steps, 0.9):.0f}"
        ok = "yes" if abs(self.error) <= GOAL else "**no**"
        return [
            self.case.name,
            f"`{self.case.layout.describe()}`",
            f"{self.probe.matmul_flops_per_s / 1e9:.0f}",
            f"{1e3 * p.step_time_s:.0f}",
            f"{1e3 * self.measured:.0f} ({spread})",
            f"{100 * self.error:+.0f}%",
            ok,
            parts,
            f"{self.imbalance:.2f}x ({1e3 * self.balanced.step_time_s:.0f})"
            if self.imbalance and self.balanced
            else "",
            "" if self.others is None else f"{self.others:.2f}",
        ]


def probe_text(label: str, m: Measurement) -> str:
    return (
        f"{label}: fp32 matmul {m.matmul_flops_per_s / 1e9:.1f} GFLOP/s per rank, SDPA "
        f"{m.attention_share:.2f} of it, copy {m.memory_bytes_per_s / 1e9:.2f} GB/s, gloo all-reduce "
        f"{m.all_reduce_bytes_per_s / 1e9:.2f} GB/s + {1e6 * m.all_reduce_latency_s:.0f} us per message idle, "
        f"{1e6 * m.loaded_latency_s:.0f} us between compute; all-gather {m.all_gather_bytes_per_s / 1e9:.2f} "
        f"GB/s + {1e6 * m.all_gather_latency_s:.0f} us ({m.probe_seconds:.0f} s)"
    )


# The probe's figures as the report states them: (label, Measurement field, scale, unit, what it is).
FIGURES = (
    ("fp32 matmul", "matmul_flops_per_s", 1e-9, "GFLOP/s", ""),
    ("SDPA", "attention_share", 1.0, "of matmul's rate", ""),
    ("copy", "memory_bytes_per_s", 1e-9, "GB/s", ""),
    ("eager elementwise (AdamW)", "elementwise_share", 1.0, "of the copy's rate", ""),
    ("gloo all-reduce", "all_reduce_bytes_per_s", 1e-9, "GB/s", " bus bandwidth"),
    ("idle latency", "all_reduce_latency_s", 1e6, "us", " per message"),
    ("all-gather", "all_gather_bytes_per_s", 1e-9, "GB/s", " (the planner's link bandwidth)"),
    ("latency per message between compute", "loaded_latency_s", 1e6, "us", " (the planner's)"),
    ("pair exchange between compute", "p2p_bytes_per_s", 1e-9, "GB/s", ""),
    ("after", "p2p_latency_s", 1e6, "us", " (ring hops, pipeline messages)"),
)


def spread(probes: list[Measurement], name: str, scale: float, unit: str) -> str:
    values = [getattr(m, name) * scale for m in probes]
    return f"{min(values):.2f}-{max(values):.2f} {unit} (median {statistics.median(values):.2f})"


def report(outcomes: list[Outcome], probes: list[Measurement], args: argparse.Namespace, took: float) -> str:
    within = sum(abs(o.error) <= GOAL for o in outcomes)
    names = list(dict.fromkeys(o.case.name for o in outcomes))
    every = sum(all(abs(o.error) <= GOAL for o in outcomes if o.case.name == n) for n in names)
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; run took {took:.0f} s",
        f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other jobs); {RANKS} ranks x "
        f"{launcher_threads(RANKS)} threads (`meshtron train --nproc {RANKS}`'s default)",
        f"the machine, probed {len(probes)} times (before every run and after the last; each prediction "
        f"uses the mean of the probes just before and just after its run), per rank with all {RANKS} ranks "
        "at once: "
        + ", ".join(
            f"{label} {spread(probes, name, scale, unit)}{after}"
            for label, name, scale, unit, after in FIGURES
        ),
        f"runs: `meshtron train --nproc {RANKS}`, {args.steps} steps each; measured = median `step_time_s` "
        f"(rank 0's metrics.jsonl) of the last {args.steps - args.warmup} (p10-p90 in brackets)",
        f"other jobs' cores: the CPU the rest of the machine used during the run (of {os.cpu_count()}; "
        "from /proc/stat less our processes' own), which the probes around the run may not have seen",
        "MoE routing imbalance: the worst layer's max / mean tokens per expert (median over the measured "
        "steps), the planner's `imbalance` input for these rows (the busiest expert rank's work and "
        "traffic over the mean: exact with one expert per rank, an upper bound with more); an untrained "
        "router is far from balanced and no planner can know by how much, so the measured figure is "
        "given, and the prediction at balanced routing (the planner's default) is in brackets",
        f"reproduce: `python benchmarks/planner_cpu.py{''.join(' ' + a for a in sys.argv[1:])}`",
        f"**{within} of {len(outcomes)}** runs predicted within {100 * GOAL:.0f}% of their measured step; "
        f"{every} of {len(names)} layouts in every run",
    ]
    header = (
        "case | layout | probe GFLOP/s | predicted step ms | measured step ms (p10-p90) | error "
        "| within 25% | predicted parts (ms) | MoE routing imbalance (predicted ms if balanced) "
        "| other jobs' cores during the run"
    )
    caption = "Predicted against measured step time (error = predicted / measured - 1):"
    blocks = [[f"- {f}" for f in facts], table(header, [o.row() for o in outcomes], caption)]
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def around(before: Measurement, after: Measurement) -> Measurement:
    """The mean of two probes' figures: the machine during the run between them."""
    mean = {
        f.name: (getattr(before, f.name) + getattr(after, f.name)) / 2
        for f in fields(Measurement)
        if isinstance(getattr(before, f.name), float)
    }
    return replace(before, **mean)


def predicted(outcomes: list[Outcome], probes: list[Measurement]) -> None:
    """Each case's prediction, from the mean of the probes just before and just after its run: other
    jobs on a shared machine come and go, and the prediction should see the machine the run saw."""
    for i, o in enumerate(outcomes):
        o.probe = around(probes[i], probes[i + 1]) if len(probes) > i + 1 else probes[i]
        o.predicted = estimate(o.cfg, cluster_from(o.probe), imbalance=o.imbalance or 1.0)
        o.balanced = estimate(o.cfg, cluster_from(o.probe))


def measure_cases(cases: list[Case], args: argparse.Namespace) -> tuple[list[Outcome], list[Measurement]]:
    """Probe and run every case in turn (or only probe), then probe once more at the end."""
    outcomes, probes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # Every case once, then all of them again: two runs a few minutes apart show the spread.
        for case in [c for _ in range(args.rounds) for c in cases]:
            probes.append(probe(RANKS, reprobe=not args.cached))
            cfg, flags = case_config(case, args.steps)
            o = Outcome(case, cfg, estimate(cfg, cluster_from(probes[-1])), probes[-1])
            outcomes.append(o)
            parts = {k: round(1e3 * v) for k, v in o.predicted.time.items() if v}
            print(f"{case.name}: {probe_text('probe', o.probe)}")
            print(f"  predicted {1e3 * o.predicted.step_time_s:.0f} ms {parts} (from this probe)", flush=True)
            if not args.predict_only:
                rows, o.others = run_case(case, flags, args.steps, Path(tmp) / f"{case.name}-{len(outcomes)}")
                rows = rows[args.warmup :]
                o.steps = [r["step_time_s"] for r in rows]
                if "moe_imbalance" in rows[0]:
                    o.imbalance = statistics.median(r["moe_imbalance"] for r in rows)
                print(f"  measured {1e3 * o.measured:.0f} ms", flush=True)
    if not args.predict_only:
        probes.append(probe(RANKS, reprobe=not args.cached))
        predicted(outcomes, probes)
    return outcomes, probes


def replay(path: Path, args: argparse.Namespace) -> tuple[list[Outcome], list[Measurement]]:
    """The runs and probes of an earlier `--save`, predicted again with today's planner and constants
    (for calibrating them without running anything)."""
    saved = json.loads(path.read_text())
    by_name = {c.name: c for c in CASES}
    probes = [Measurement(**p) for p in saved["probes"]]
    outcomes = []
    for entry, m in zip(saved["cases"], probes, strict=False):
        case = by_name[entry["case"]]
        cfg, _ = case_config(case, args.steps)
        outcomes.append(
            Outcome(case, cfg, estimate(cfg, cluster_from(m)), m, entry["steps"], entry.get("imbalance"))
        )
    predicted(outcomes, probes)
    return outcomes, probes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every case, one round after another")
    parser.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    parser.add_argument("--cached", action="store_true", help="use the cached probe instead of measuring")
    parser.add_argument("--save", help="also write the probes and measured steps to this JSON file")
    parser.add_argument("--replay", help="predict the runs of a --save file again instead of running")
    parser.add_argument("--out", default=str(RESULTS), help="results file; '-' writes nothing")
    args = parser.parse_args()
    started = time.perf_counter()
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    outcomes, probes = replay(Path(args.replay), args) if args.replay else measure_cases(cases, args)
    if args.predict_only:
        return 0
    if args.save:
        saved = [
            {"case": o.case.name, "steps": o.steps, "imbalance": o.imbalance, "others": o.others}
            for o in outcomes
        ]
        Path(args.save).write_text(json.dumps({"cases": saved, "probes": [asdict(m) for m in probes]}))
    body = report(outcomes, probes, args, time.perf_counter() - started)
    publish(body, args.out, TITLE, Path(__file__).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
