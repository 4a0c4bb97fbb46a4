"""Benchmark: Muon's owners against the redundant alternative, per layout (4 gloo ranks, CPU).

The optimizer's Muon step (momentum, Newton-Schulz, update; AdamW's part excluded) of the demo's model,
two ways, on every rank of a 4-rank world, from the same gradients:

  owners      meshtron's (train/muon.py): each matrix orthogonalized once, by its owner; rows to the
              owner and back by all-to-all (ZeRO), or the owners' results to the replicas (DDP)
  redundant   every rank orthogonalizes every matrix: ZeRO all-gathers each matrix's U (bf16, as the
              owners' exchange sends it) first; DDP needs no communication at all

Parity first: one step each from the same state gives the same weights on every rank (bit for bit:
the same Newton-Schulz on the same whole matrix), or nothing is timed. Then the median over rounds of
each way's step time (slowest rank) and the bytes it sends per rank per step.

    python benchmarks/muon_exchange.py            # the table into RESULTS.md
    python benchmarks/muon_exchange.py --rounds 3 --out -
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from reporting import RESULTS, cpu_model, table, write_section

from meshtron.comm.workers import WorkerPool
from meshtron.testing.parity import trainer_for
from meshtron.train.muon import lr_ratio, newton_schulz

TITLE = "## Muon's owners against orthogonalizing everything everywhere (4 gloo ranks, CPU)"
DEMO = ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=8", "--model.n_kv_heads=4",
        "--model.ffn_dim=688", "--model.vocab_size=4096", "--data.tokenizer=byte", "--training.seq_len=128",
        "--training.global_batch=16", "--training.optimizer=muon", "--run.plot=false"]  # fmt: skip
LAYOUTS = {
    "ZeRO-2 x 4": ["--parallel.dp_shard=4", "--parallel.zero=2", "--training.micro_batch=4"],
    "DDP x 4": ["--parallel.dp_replicate=4", "--parallel.dp_shard=1", "--training.micro_batch=4"],
}


def redundant_step(opt: Any, lr: float, weight_decay: float) -> None:
    """Every 2-D matrix gathered whole on every rank (row blocks: all-gathered in the Newton-Schulz
    dtype) and orthogonalized there; each rank updates its own rows."""
    s, group = opt.settings, opt.dp.group
    params = next(g["params"] for g in opt.param_groups if g.get("muon"))
    updates = {id(p): opt._momentum(p) for p in params}
    for e in opt.flat:
        u = updates[id(e.param)][: e.rows].to(s.dtype)
        if opt.dp.split and group is not None and group.size > 1:
            per = -(-e.shape[0] // group.size)
            block = u.new_zeros((per, e.shape[1]))
            block[: e.rows] = u
            u = opt.dp.comm.all_gather_tensor(block, group)[: e.shape[0]]
        x = newton_schulz(u, s.ns_steps, s.dtype)[e.start : e.start + e.rows]
        opt._apply(e.param.data, e.rows, x, lr, weight_decay, lr_ratio(s.adjust_lr, *e.shape))


def owners_step(opt: Any, lr: float, weight_decay: float) -> None:
    opt._muon_step(next(g["params"] for g in opt.param_groups if g.get("muon")), lr, weight_decay)


WAYS = {"owners": owners_step, "redundant": redundant_step}


def measure(overrides: list[str], rounds: int) -> dict[str, Any]:
    """On every rank: parity of the two ways, then their step times and bytes."""
    trainer = trainer_for(overrides)
    trainer.compute_gradients()
    opt, comm = trainer.optimizer, trainer.comm
    muon = next(g for g in opt.param_groups if g.get("muon"))
    start = {id(p): (p.data.clone(), copy.deepcopy(opt.state[p])) for p in muon["params"]}

    def reset() -> None:
        for p in muon["params"]:
            p.data.copy_(start[id(p)][0])
            opt.state[p] = copy.deepcopy(start[id(p)][1])

    after = {}
    for name, way in WAYS.items():
        reset()
        way(opt, 1e-3, 0.1)
        after[name] = [p.data.clone() for p in muon["params"]]
    same = all(torch.equal(a, b) for a, b in zip(after["owners"], after["redundant"], strict=True))
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    sent = {}
    for _ in range(rounds):
        for name, way in WAYS.items():
            reset()
            dist.barrier()
            began = time.perf_counter()
            with comm.recording() as recorded:
                way(opt, 1e-3, 0.1)
            times[name].append(time.perf_counter() - began)
            sent[name] = recorded.stats.total_bytes()
    return {"same": same, "times": times, "sent": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    pool = WorkerPool(4)
    try:
        for layout, flags in LAYOUTS.items():
            ranks = pool.run(measure, [*DEMO, *flags], args.rounds)
            if not all(r["same"] for r in ranks):
                raise SystemExit(f"{layout}: the two ways' weights differ: nothing timed")
            slowest = {w: [max(r["times"][w][i] for r in ranks) for i in range(args.rounds)] for w in WAYS}
            median = {w: statistics.median(v) for w, v in slowest.items()}
            sent = {w: max(r["sent"][w] for r in ranks) / 2**20 for w in WAYS}
            rows.append([layout, f"{1e3 * median['owners']:.1f}", f"{1e3 * median['redundant']:.1f}",
                         f"{median['owners'] / median['redundant']:.2f}", f"{sent['owners']:.2f}",
                         f"{sent['redundant']:.2f}"])  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        pool.close()
    header = ("layout | owners' step ms (median, slowest rank) | redundant step ms | ratio | owners MiB sent "
              "per rank | redundant MiB sent per rank")  # fmt: skip
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {cpu_model()}; 4 gloo ranks on 2 cores, one thread each; "
        f"took {time.perf_counter() - started:.0f} s",
        "the demo's model (dim 256, 4 layers, 28 Muon matrices), bf16 Newton-Schulz of 5 steps; the Muon step "
        f"alone, {args.rounds} rounds alternating; parity first: both ways give the same weights, bit for bit",
        f"reproduce: `python benchmarks/muon_exchange.py --rounds {args.rounds}`",
    ]
    body = "\n".join(f"- {f}" for f in facts) + "\n\n" + "\n".join(table(header, rows)) + "\n"
    print(body)
    if args.out != "-":
        write_section(Path(args.out), TITLE, "muon_exchange.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
