"""MoE at cluster scale on this machine: folded against unfolded experts, and the flat, dedup and
hierarchical dispatches over two "nodes" (4 gloo ranks, run.gpus_per_node = 2), on a fine-grained MoE
(16 experts of width 128, top-4 from the best 2 of 4 groups, one shared expert).

  folding   attention at tp 2 x dp 2 in both; the experts split over tp with ep 2 over the dp ranks
            (etp = tp, unfolded) or whole with ep 4 over all four ranks (etp = 1, folded)
  dispatch  dp 4 with ep 4 over two nodes of 2 ranks: alltoall (a row per assignment), dedup (a row per
            token and rank) and hierarchical (a row per token and node over the network, then per rank
            inside the node)

Parity first: the layouts of each comparison must give the same losses (1e-5 relative) at every step, or
nothing is reported. Each layout runs `--steps` training steps in fresh gloo worker processes (one thread
per rank; the first `--warmup` are not timed), rounds alternating between layouts; the tables give
medians, rank 0's bytes per step by group, and the bytes its all-to-alls sent to the other node (counted
by the all-to-alls themselves: CommStats.network). Writes its section of benchmarks/RESULTS.md.

    python benchmarks/moe_layouts.py [--steps 6] [--warmup 2] [--rounds 2] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from reporting import cpu_model, parser, publish, rounds_of_runs, table

TITLE = "## MoE layouts: folded vs unfolded experts, flat vs dedup vs hierarchical dispatch (4 gloo ranks)"
SEQ = 512
BASE = [
    "--model.dim=256",
    "--model.n_layers=4",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.ffn_dim=688",
    "--model.n_experts=16",
    "--model.top_k=4",
    "--model.moe_ffn_dim=128",
    "--model.n_shared_experts=1",
    "--model.router=sigmoid",
    "--model.n_expert_groups=4",
    "--model.topk_expert_groups=2",
    "--model.vocab_size=260",
    "--data.tokenizer=byte",
    f"--training.seq_len={SEQ}",
    "--training.global_batch=8",
    "--training.micro_batch=2",
    "--training.lr=1e-3",
    "--run.plot=false",
    "--run.sample_tokens=0",
    "--run.gpus_per_node=2",
    "--training.warmup_steps=1",
]
FOLDING = {
    "unfolded: ep 2, etp = tp 2": ["--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=2", "--training.micro_batch=4"],
    "folded: ep 4, etp 1": ["--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=4", "--parallel.etp=1", "--training.micro_batch=4"],
}  # fmt: skip
DISPATCH = {
    name: ["--parallel.ep=4", f"--parallel.ep_dispatch={name}"]
    for name in ("alltoall", "dedup", "hierarchical")
}


def measure(layouts: dict[str, list[str]], args, work: Path) -> dict[str, list[dict]]:
    """Each layout's rank-0 results over the rounds: losses, step times, the last step's bytes by group
    and the bytes its all-to-alls sent to the other node."""
    runs = rounds_of_runs({k: (4, [*BASE, *o]) for k, o in layouts.items()}, args.rounds, args.steps, work)
    return {
        name: [
            {
                "losses": [r["loss"] for r in rows],
                "times": [r["step_time_s"] for r in rows],
                "bytes": rows[-1]["comm_bytes_by_group"],
                "network": rows[-1]["comm_network_bytes_by_group"],
            }
            for rows in per_round
        ]
        for name, per_round in runs.items()
    }


def rows_of(results: dict[str, list[dict]], warmup: int) -> list[list[str]]:
    """One row per layout, against the first layout (the baseline): parity, step, bytes."""
    names = list(results)
    base = results[names[0]]
    base_time = statistics.median(t for r in base for t in r["times"][warmup:])
    rows = []
    for name in names:
        worst = max(
            abs(a - b) / abs(b)
            for x, y in zip(results[name], base, strict=True)
            for a, b in zip(x["losses"], y["losses"], strict=True)
        )
        if worst > 1e-5:
            raise SystemExit(f"{name}: losses differ from {names[0]}'s by {worst:.1e} (parity fails)")
        first = results[name][0]
        time = statistics.median(t for r in results[name] for t in r["times"][warmup:])
        ep = {g: b for g, b in first["bytes"].items() if g.startswith("ep")}
        rows.append(
            [
                name,
                f"{time:.3f}",
                f"{time / base_time:.2f}",
                ", ".join(f"{g} {b / 2**20:.2f}" for g, b in sorted(ep.items())),
                f"{first['bytes'].get('tp', 0.0) / 2**20:.2f}",
                f"{sum(first['network'].values()) / 2**20:.2f}",
                f"{worst:.1e}",
            ]
        )
    return rows


HEADER = (
    "layout | step (s, median) | vs first | ep bytes per step by group (MiB) | tp bytes (MiB) | "
    "all-to-all bytes to the other node (MiB) | losses differ by"
)


def main() -> int:
    p = parser(__doc__, steps=6, warmup=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating between layouts")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folding = measure(FOLDING, args, Path(tmp) / "folding")
        dispatch = measure(DISPATCH, args, Path(tmp) / "dispatch")
    body = "\n".join(
        [
            f"{cpu_model()}, fp32, one thread per rank, {args.steps} steps of 8 x {SEQ} tokens ({args.warmup} "
            f"untimed), {args.rounds} rounds alternating; model: dim 256, 4 MoE layers, 16 experts of 128, "
            "top-4 of the best 2 of 4 groups, one shared expert. Ranks 0-1 and 2-3 are the two nodes "
            "(run.gpus_per_node = 2). Reproduce: `python benchmarks/moe_layouts.py`.",
            "",
            *table(
                HEADER,
                rows_of(folding, args.warmup),
                "Folding, attention at tp 2 (sp) x dp 2; rank 0's bytes.",
            ),
            "",
            *table(
                HEADER,
                rows_of(dispatch, args.warmup),
                "Dispatch, dp 4 with ep 4 over two nodes; rank 0's bytes.",
            ),
        ]
    )
    publish(body, args.out, TITLE, Path(__file__).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
