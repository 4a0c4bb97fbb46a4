"""Per-step metrics: MFU (from plan/flops.py's model FLOPs), memory (peak, and bytes held in model state), the console line,
metrics.jsonl, TensorBoard, Weights & Biases, plot."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshtron.engines.engine import DataParallelEngine
from meshtron.observe.wandb_log import WandbSettings, start_wandb
from meshtron.probe.peak import format_mfu
from meshtron.utils.resident import resident_peak_bytes


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_peak_bytes()


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; DTensors by
    their local tensor)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    grad_buffers: Iterable[torch.Tensor] = (),
) -> dict[str, int]:
    """Bytes held in parameters, their gradients (and any other gradient buffers) and optimizer state,
    counted from tensor storage, once per storage (views of one buffer count once; AdamW's scalar step
    counters are left out)."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None] + list(grad_buffers)
    states = [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1
    ]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(grads),
        "optimizer": storage_bytes(states),
    }


def model_state_bytes(
    engine: DataParallelEngine, optimizer: torch.optim.Optimizer, outer: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """`state_bytes` of a data-parallel engine: the model's and the optimizer's parameters; `outer`:
    DiLoCo's outer weights and momentum (train/diloco.py), counted with the optimizer's state."""
    held = state_bytes(
        list(engine.model.parameters()) + engine.optimizer_params(), optimizer, engine.grad_buffers()
    )
    return {**held, "optimizer": held["optimizer"] + storage_bytes(list(outer))}


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row that TensorBoard and W&B plot (not the step, not per-group dicts)."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class MetricsLogger:
    """Writes one row per optimizer step to metrics.jsonl (and TensorBoard when installed, W&B when asked
    for); rank 0 only."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        append: bool = False,
        tensorboard: bool = True,
        last_step: int | None = 0,
        wandb: WandbSettings | None = None,
    ):
        """`append`: continue a resumed run's file, dropping any rows after `last_step` (the steps a crash
        lost since the checkpoint, which the resumed run computes and logs again; None: keeping every row,
        as a replica group that writes beside others does)."""
        self.run_dir = run_dir
        self.enabled = enabled
        self.shared = last_step is None  # other processes write rows to the same file
        self.rows: list[dict[str, Any]] = []  # this attempt's steps (its summary's)
        self.eval_rows: list[dict[str, Any]] = []  # validation rows (train/evaluate.py), same file
        self.earlier: list[dict[str, Any]] = []  # a resumed run's rows before it (the pictures show all)
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if append and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip()]
            if last_step is not None:
                kept = [line for line in kept if json.loads(line)["step"] <= last_step]
                path.write_text("".join(line + "\n" for line in kept))
            self.earlier = [json.loads(line) for line in kept]
        self._file = path.open("a" if append else "w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._tb = None
            else:
                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb is not None:
            self._wandb = start_wandb(wandb)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        (self.eval_rows if "val_loss" in row else self.rows).append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in scalars(row).items():
                self._tb.add_scalar(key, value, row["step"])
        if self._wandb is not None:
            self._wandb.log(scalars(row), step=row["step"])

    def history(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(training rows, validation rows) of the whole run as metrics.jsonl holds it: a resumed run's
        earlier steps, then this attempt's (a file shared with other writers: read again)."""
        if self.shared and self._file is not None:
            self._file.flush()
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            return [r for r in rows if "val_loss" not in r], [r for r in rows if "val_loss" in r]
        earlier_eval = [r for r in self.earlier if "val_loss" in r]
        return [r for r in self.earlier if "val_loss" not in r] + self.rows, earlier_eval + self.eval_rows

    @staticmethod
    def console_line(row: dict[str, Any]) -> str:
        return (
            f"step {row['step']:>5} | loss {row['loss']:.4f}"
            + (f" (MTP {row['mtp_loss']:.4f})" if "mtp_loss" in row else "")
            + f" | lr {row['lr']:.2e} | grad norm "
            f"{row['grad_norm']:.3f} | {row['tokens_per_sec']:,.0f} tok/s | MFU {format_mfu(row['mfu'], row.get('mfu_note'))} | "
            f"peak mem {_human(row['peak_mem_bytes'])}B | comm {_human(row['comm_bytes'])}B"
            + (f" | bubble {100 * row['pp_bubble']:.0f}%" if "pp_bubble" in row else "")
            + (f" | MoE imbalance {row['moe_imbalance']:.2f}x" if "moe_imbalance" in row else "")
            + (f", dropped {100 * row['moe_dropped']:.1f}%" if row.get("moe_dropped") else "")
            + (f" | SKIPPED, {row['reason']}" if row.get("skipped") else "")
        )

    @staticmethod
    def val_line(row: dict[str, Any]) -> str:
        return f"step {row['step']:>5} | val loss {row['val_loss']:.4f} | val ppl {row['val_ppl']:,.2f}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
