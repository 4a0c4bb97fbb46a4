"""Goodput under failures, on paper: checkpoint-restart against healing one replica group. Torch-free.

The share of wall time that becomes training progress, for a layout whose step takes T seconds and whose
ranks each own B bytes of state to save or send (fp32 weights and optimizer moments of their rows), on N
GPUs failing f times per GPU-day:

  the job's mean time between failures      M = 86,400 / (f·N) seconds
  checkpoint-restart                        every failure stops every rank and rolls back to the last
  (Young 1974; Daly 2006)                   checkpoint. Saving stalls C = B / (r·storage): each row is
                                            written once, whatever the r = dp_replicate copies of it; the
                                            interval that wastes least is τ = sqrt(2·C·M) − C (Daly's first
                                            order, for C < 2M). Per failure: τ/2 of rolled-back work on
                                            average, and the restart R plus every rank reading its B back.
                                            goodput = (1 − C/(τ + C)) · (1 − (τ/2 + R + B/storage) / M)
  healing a replica group                   only the failed dp_replicate slice (1/r of the job) stops; it
  (torchft: quorum per step, state          restarts (R) and copies its state from a live replica over the
  sent by a live peer)                      network (B / network), while the r − 1 others keep stepping;
                                            the step in flight is discarded everywhere.
                                            goodput = 1 − (T + (R + B/network) / r) / M

The first factor of checkpoint-restart is the time spent saving (C of every τ + C); the second, the time
lost per failure. `storage` is each GPU's share of the job's checkpoint bandwidth.
Healing still needs periodic checkpoints against the loss of the whole job, far rarer; they are not
counted. Llama 3 405B's pre-training saw 419 unexpected interruptions in 54 days on 16,384 GPUs
(Llama 3 paper, §3.3.4): f = 4.7e-4 per GPU-day, M = 3.1 hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """The failure rate and the costs a failure or a checkpoint has, for one layout on one cluster."""

    failures_per_gpu_day: float
    gpus: int
    step_s: float  # T
    state_bytes: float  # B: one rank's parameters and optimizer state
    storage_bytes_per_s: float  # per GPU, writing and reading checkpoints
    network_bytes_per_s: float  # per GPU, between replicas (across nodes)
    restart_s: float  # R: a process (group) back, its communicators formed
    replicas: int = 1  # r: dp_replicate copies of every row, of which a checkpoint writes one

    @property
    def mtbf_s(self) -> float:
        return DAY_S / (self.failures_per_gpu_day * self.gpus)

    @property
    def checkpoint_s(self) -> float:
        """C: each GPU's share of writing the job's state, once per row (DCP skips the replicas' copies)."""
        return self.state_bytes / self.replicas / self.storage_bytes_per_s

    @property
    def load_s(self) -> float:
        """Every rank reads back its own rows."""
        return self.state_bytes / self.storage_bytes_per_s

    @property
    def heal_s(self) -> float:
        return self.restart_s + self.state_bytes / self.network_bytes_per_s


def checkpoint_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's optimum: sqrt(2·C·M) − C, or M when a save takes longer than 2M (checkpoints do not pay)."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * checkpoint_s * mtbf_s) - checkpoint_s


def checkpoint_restart_goodput(f: FailureModel, interval_s: float | None = None) -> float:
    """Useful share of wall time with checkpoints every `interval_s` (default: Daly's optimum)."""
    tau = checkpoint_interval_s(f.checkpoint_s, f.mtbf_s) if interval_s is None else interval_s
    saving = f.checkpoint_s / (tau + f.checkpoint_s)
    lost = (tau / 2 + f.restart_s + f.load_s) / f.mtbf_s
    return max(0.0, (1 - saving) * (1 - lost))


def healing_goodput(f: FailureModel, replicas: int) -> float:
    """Useful share of wall time when one of `replicas` replica groups heals from a live one."""
    if replicas < 2:
        raise ValueError("healing needs a live replica to copy from: dp_replicate >= 2")
    return max(0.0, 1 - (f.step_s + f.heal_s / replicas) / f.mtbf_s)


def goodput_lines(f: FailureModel, replicas: int) -> list[str]:
    """What `meshtron plan --failures-per-gpu-day` prints for one layout."""
    tau = checkpoint_interval_s(f.checkpoint_s, f.mtbf_s)
    lines = [
        f"failures: {f.failures_per_gpu_day:g} per GPU-day on {f.gpus:,} GPUs, one every "
        f"{f.mtbf_s / 60:,.1f} min; each rank holds {f.state_bytes / 2**30:.1f} GiB to save or send",
        f"  checkpoint-restart: save {f.checkpoint_s:.0f} s every {tau / 60:,.1f} min (Young/Daly), "
        f"restart and load {f.restart_s + f.load_s:.0f} s: goodput {100 * checkpoint_restart_goodput(f):.1f}%",
    ]
    if replicas < 2:
        lines.append(
            "  replica healing: needs dp_replicate >= 2 (a live replica to copy from); plan with "
            '--layout "dp_replicate=2" to compare'
        )
    else:
        lines.append(
            f"  replica healing: 1 of {replicas} replica groups out for {f.heal_s:.0f} s (restart "
            f"{f.restart_s:.0f} s, state from a live peer {f.heal_s - f.restart_s:.1f} s), one step lost: "
            f"goodput {100 * healing_goodput(f, replicas):.1f}%"
        )
    return lines
