"""A model bigger than one rank: 0.8B parameters (fp32 weights, gradients and AdamW state about 12 GB)
trained a few steps on this 24 GB, 2-core machine under ZeRO-3 x 4, tp 2 (+ sp) x pp 2 and pp 4, each
rank's resident peak against the planner's prediction (the method of memory_vs_plan.py: the peak minus
the runtime's fixed overhead, measured between steps as resident bytes beyond live tensors).

Every rank builds the model on the meta device and materialises only what it holds, so no rank ever
holds the whole model (docs/data-parallel.md, "Built on the meta device").

Usage: python benchmarks/big_model.py [--only NAME ...] [--steps N] [--out RESULTS.md | -]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from memory_vs_plan import report, run
from reporting import RESULTS, write_section

from meshtron.testing.peak_memory import model_overrides

# About 0.79B parameters: dim 2048, 14 layers, 16 heads (8 KV), FFN 5632, vocabulary 32000.
BIG = model_overrides(2048, 14, 16, 8, 5632, 32000, seq_len=256, batch=4, micro=1)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "zero3_4": (4, ["--parallel.zero=3", "--parallel.dp_shard=4"]),
    "tp2_sp_pp2": (4, ["--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2", "--parallel.dp_shard=1"]),
    "pp4": (4, ["--parallel.pp=4", "--parallel.dp_shard=1"]),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    started = time.time()
    rows = run(
        {name: (LAYOUTS[name][0], [*BIG, *LAYOUTS[name][1]]) for name in args.only or LAYOUTS}, args.steps
    )
    body = "\n".join(
        [
            "Model: dim 2048, 14 layers, 16 heads (8 KV), FFN 5632, vocabulary 32000 (0.79B parameters; fp32 "
            f"weights + gradients + AdamW state 12.6 GB), sequences of 256, global batch 4; 4 ranks on 2 cores; "
            f"{args.steps} steps per layout, {time.time() - started:.0f} s in all. "
            "Reproduce: `python benchmarks/big_model.py`.",
            "",
            report(rows, args.steps).split("\n\n", 1)[1],
        ]
    )
    print(body)
    if args.out != "-":
        write_section(Path(args.out), "## A model bigger than one rank", "big_model.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
