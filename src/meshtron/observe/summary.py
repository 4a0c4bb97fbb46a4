"""The run summary: what a run achieved, once, at its end (console and `<run.dir>/summary.json`). Its
keys:

  median_tokens_per_sec   over this attempt's steps (the median: step 1's warm-up and a stray slow step
                          move it little)
  median_mfu              the MFU of that median rate (MFU is proportional to tokens/s); null when the
                          reference is unknown or the MFU would be above 100%, with `mfu_note` saying why
  peak_mem_bytes          the largest peak of any step (rank 0's: resident memory on CPU, allocated on GPU)
  wall_time_s             from the trainer's start (set-up and data preparation included) to the summary
  final_train_loss        the last step's loss; final_val_loss the last evaluation's (null without one)

The trainer adds, when they apply (Trainer.operations_summary): `checkpoint_stall_s` (sync or async, the
saves, the median and largest stall) and `memory_by_phase` (profiling.py: each rank's peaks per phase
and the planner's parts for its stage).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from meshtron.probe.peak import format_mfu, shown_mfu
from meshtron.utils.words import plural

SUMMARY_FILE = "summary.json"


def run_summary(
    rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    wall_time_s: float,
    flops_per_token: float,
    peak_flops: float,
    peak_source: str,
    world_size: int,
) -> dict[str, Any]:
    """The summary of a run's metrics rows (training steps and evaluations of this attempt)."""
    rates = [r["tokens_per_sec"] for r in rows]
    median_rate = statistics.median(rates) if rates else float("nan")
    mfu, note = shown_mfu(flops_per_token * median_rate / (peak_flops * world_size))
    return {
        "steps": len(rows),
        "last_step": rows[-1]["step"] if rows else None,
        "median_tokens_per_sec": median_rate if rates else None,
        "median_mfu": mfu,
        **({"mfu_note": note} if note else {}),
        "mfu_reference": peak_source,
        "peak_mem_bytes": max((r["peak_mem_bytes"] for r in rows), default=None),
        "wall_time_s": wall_time_s,
        "final_train_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": eval_rows[-1]["val_loss"] if eval_rows else None,
    }


def summary_text(summary: dict[str, Any]) -> str:
    """The summary as the console's last line."""
    minutes, seconds = divmod(summary["wall_time_s"], 60)
    parts = [f"meshtron: summary: {plural(summary['steps'], 'step')} in {int(minutes)} min {seconds:.0f} s"]
    if summary["steps"]:
        parts += [
            f"median {summary['median_tokens_per_sec']:,.0f} tok/s",
            f"MFU {format_mfu(summary['median_mfu'], summary.get('mfu_note'))}",
            f"peak mem {summary['peak_mem_bytes'] / 1e6:,.0f} MB",
            f"final train loss {summary['final_train_loss']:.4f}",
        ]
    if summary["final_val_loss"] is not None:
        parts.append(f"final val loss {summary['final_val_loss']:.4f}")
    return ", ".join(parts)


def write_summary(summary: dict[str, Any], run_dir: Path) -> Path:
    """`<run_dir>/summary.json`, written atomically (a reader never sees half of it)."""
    path = run_dir / SUMMARY_FILE
    tmp = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, path)
    return path
