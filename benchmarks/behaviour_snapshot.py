"""Behaviour snapshot: a reshaping of the code must not change what meshtron computes, bit for bit.

Runs `meshtron train` (the command, as a user does) on 29 layouts that cover every parallelism and their
compositions (DDP, ZeRO-1/2/3, HSDP, fully_shard, SimpleFSDP, tp ± sp, every cp implementation, ep with
both dispatchers and etp, every pipeline schedule with the DualPipeV overlap, cost balance, an 8-rank
composition, evaluation, compile) for 4 steps of the tiny model, and records each step's loss, gradient
norm and communication (bytes and calls per group) to JSON. Snapshot before a change, snapshot after,
compare: every number must be identical.

    python benchmarks/behaviour_snapshot.py record before.json            # on the old checkout
    python benchmarks/behaviour_snapshot.py record after.json             # on the new one
    python benchmarks/behaviour_snapshot.py compare before.json after.json

`record --only NAME ...` runs some layouts; `--tree DIR` runs another checkout's src/ (its
`python -m meshtron`). About 3.5 minutes on 2 cores. Not a performance benchmark: nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = "--model.name=tiny --data.tokenizer=byte --training.seq_len=32 --training.global_batch=8 "
TINY += "--training.lr=3e-3 --training.warmup_steps=2 --training.steps=4 --training.micro_batch=2 "
TINY += "--run.plot=false --run.sample_tokens=0"
MOE = "--model.name=tiny-moe --model.shared_expert_gate=true --model.z_loss_coef=0.001 --model.router_bias_rate=0.01"
PP = "--parallel.pp=2 --training.micro_batch=2"
# name: (ranks, overrides after TINY)
LAYOUTS = {
    "single": (1, ""),
    "single_moe": (1, MOE),
    "ddp2": (2, "--parallel.dp_replicate=2 --parallel.dp_shard=1"),
    "zero1": (2, "--parallel.zero=1"),
    "zero2": (2, "--parallel.zero=2"),
    "zero3": (2, "--parallel.zero=3"),
    "zero3_bf16": (2, "--parallel.zero=3 --training.dtype=bf16"),
    "hsdp": (4, "--parallel.dp_replicate=2 --parallel.dp_shard=2"),
    "fsdp_torch": (2, "--parallel.fsdp_impl=torch"),
    "simple_fsdp": (2, "--parallel.fsdp_impl=simple"),
    "tp2": (2, "--parallel.tp=2"),
    "tp2_sp_sel": (2, "--parallel.tp=2 --parallel.sp=true --training.recompute=selective"),
    "cp2_ring": (2, "--parallel.cp=2"),
    "cp2_allgather": (2, "--parallel.cp=2 --parallel.cp_impl=allgather"),
    "cp2_alltoall": (2, "--parallel.cp=2 --parallel.cp_impl=alltoall"),
    "cp4_hybrid": (4, "--parallel.cp=4 --parallel.cp_impl=hybrid --parallel.cp_ulysses=2"),
    "ep2": (2, f"{MOE} --parallel.ep=2"),
    "ep2_allgather_z1": (2, f"{MOE} --parallel.ep=2 --parallel.ep_dispatch=allgather --parallel.zero=1"),
    "ep2_tp2_etp": (4, f"{MOE} --parallel.ep=2 --parallel.tp=2 --parallel.sp=true --parallel.etp=2"),
    "pp2_gpipe": (2, f"{PP} --parallel.pp_schedule=gpipe"),
    "pp2_1f1b_full": (2, f"{PP} --training.recompute=full"),
    "pp2_interleaved": (2, f"{PP} --parallel.pp_schedule=interleaved --parallel.vpp=2 --model.n_layers=4"),
    "pp2_zb": (2, f"{PP} --parallel.pp_schedule=zero_bubble"),
    "pp2_zbv_tied": (2, f"{PP} --parallel.pp_schedule=zbv --parallel.vpp=2 --model.n_layers=4 --model.tie_embeddings=true"),
    "pp2_dualpipev_moe_ep": (4, f"{MOE} --parallel.pp=2 --parallel.pp_schedule=dualpipev --parallel.vpp=2 "
                             "--model.n_layers=4 --parallel.ep=2 --parallel.zero=1 --training.micro_batch=1 "
                             "--parallel.pp_overlap=true"),
    "pp2_cost_balance": (2, f"{PP} --parallel.pp_balance=cost --model.n_layers=4"),
    "mix8": (8, f"{MOE} --parallel.pp=2 --parallel.tp=2 --parallel.sp=true --parallel.cp=2 --parallel.ep=2 "
             "--model.n_layers=4 --training.micro_batch=2 --parallel.zero=2"),
    "eval_val": (2, "--data.val_fraction=0.05 --training.eval_every=2 --parallel.zero=1"),
    "compile_tp2": (2, "--parallel.tp=2 --training.compile=true"),
}  # fmt: skip
KEPT = ("loss", "grad_norm", "comm_bytes", "comm_bytes_by_group", "comm_calls_by_group", "val_loss")


def record_layout(name: str, tree: Path, work: Path) -> list[dict] | str:
    """One layout's metric rows (the kept keys and the expert loads), or its error output."""
    ranks, extra = LAYOUTS[name]
    run_dir, empty = work / name, work / "empty.toml"
    empty.write_text("")
    argv = [sys.executable, "-m", "meshtron", "train", "--config", str(empty), *TINY.split(), *extra.split()]
    argv += [f"--run.dir={run_dir}"] + (["--nproc", str(ranks)] if ranks > 1 else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree / "src"))
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree)
    if out.returncode != 0:
        return (out.stdout + out.stderr)[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k in KEPT or k.startswith("load")} for r in rows]


def compare(before: dict, after: dict) -> list[str]:
    """Every difference, one line each (none: bit for bit)."""
    diffs = []
    for name, rows in before.items():
        if isinstance(after.get(name), str) or name not in after:
            diffs.append(f"{name}: {str(after.get(name, 'missing'))[-300:]}")
            continue
        if len(rows) != len(after[name]):
            diffs.append(f"{name}: {len(rows)} rows before, {len(after[name])} after")
        for step, (a, b) in enumerate(zip(rows, after[name], strict=False), start=1):
            diffs += [
                f"{name} row {step} {key}: {a.get(key)} -> {b.get(key)}"
                for key in a | b
                if a.get(key) != b.get(key)
            ]
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the layouts and write their rows to OUT")
    rec.add_argument("out")
    rec.add_argument("--only", nargs="*", default=None, help="these layouts only")
    rec.add_argument("--tree", default=str(ROOT), help="the checkout whose src/ runs")
    cmp = sub.add_parser("compare", help="every difference between two records; exit 1 if any")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "compare":
        diffs = compare(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()))
        print("\n".join(diffs) or "identical, bit for bit")
        return 1 if diffs else 0
    records = {}
    with tempfile.TemporaryDirectory(prefix="meshtron-snapshot-") as work:
        for name in args.only or LAYOUTS:
            records[name] = record_layout(name, Path(args.tree).resolve(), Path(work))
            print(name, "ok" if isinstance(records[name], list) else f"FAILED\n{records[name]}", flush=True)
    Path(args.out).write_text(json.dumps(records, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
