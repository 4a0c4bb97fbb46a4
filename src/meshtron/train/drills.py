"""Fault injection for restart drills and tests: a rank that dies on cue (MESHTRON_KILL_AT after a step,
MESHTRON_KILL_RANK by SIGKILL as a step begins, on a launcher's first attempt only; MESHTRON_KILL_HEALING
by SIGKILL as it loads a live replica group's state, on its group's first restart)."""

from __future__ import annotations

import os
import signal


def kill_if_asked(rank: int, step: int) -> None:
    """Fault injection for restart tests and drills: MESHTRON_KILL_AT="RANK:STEP" ends rank RANK's process
    abruptly after step STEP (and its checkpoint, if one is due), on the first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ.get("MESHTRON_KILL_AT") == f"{rank}:{step}":
        os._exit(17)


def sigkill_if_asked(rank: int, step: int) -> None:
    """Fault injection for drills: MESHTRON_KILL_RANK="RANK:STEP" (several comma-separated) kills rank
    RANK's process with SIGKILL as step STEP (1-based) begins, on the first attempt only: no handler, no
    flush, no checkpoint, the other ranks left waiting in the step's first collective, as when a GPU or
    its host dies."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and f"{rank}:{step}" in os.environ.get("MESHTRON_KILL_RANK", "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def sigkill_if_healing(rank: int) -> None:
    """MESHTRON_KILL_HEALING="RANK": rank RANK (numbered group by group) dies by SIGKILL as its replica
    group, restarted once, loads a live group's state (train/fault_tolerance.py): a failure during
    healing."""
    restarted_once = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "1"
    if restarted_once and os.environ.get("MESHTRON_KILL_HEALING") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
