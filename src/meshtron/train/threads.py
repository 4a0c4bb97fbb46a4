"""How many torch threads a one-rank CPU run computes with (`meshtron train` without --nproc).

torch's default is one thread per physical core. On a machine other processes keep busy that is the
worst choice there is: every one of a step's thousands of parallel regions waits at its barrier for the
thread that the scheduler took its core from. The one-rank demo on a shared 2-core machine made
7.3-7.5 times the tokens/s with one thread as with two (load average 3 and 12-32, alternating step by
step in one process: docs/performance.md). So a one-rank CPU run takes as many threads as the load average leaves cores free, at least one and at
most torch's default; `OMP_NUM_THREADS` (or `torch.set_num_threads` in a program that calls `train`
itself) is the user's choice and is kept as it is. `--nproc N` ranks get cores // N threads each from
the launcher (commands/train.py) instead.
"""

from __future__ import annotations

import contextlib
import os

import torch

from meshtron.utils.words import plural


def free_core_threads(cores: int, load_average: float, default: int) -> int:
    """Threads for a run that starts now: the cores the other processes leave free (the load average
    rounded to a whole number of busy cores), at least 1 and at most `default`."""
    return max(1, min(default, cores - int(load_average + 0.5)))


def _cores() -> int:
    """The cores this process may run on (its affinity; a container's CPU quota is not seen)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_one_rank_threads(run_device: str) -> str | None:
    """Set this process's torch threads for a one-rank run on the CPU (`run_device`: run.device)
    unless OMP_NUM_THREADS says how many; returns the console line that says what was chosen and why,
    or None when the user chose (or the run is on a GPU)."""
    on_gpu = run_device == "cuda" or (run_device == "auto" and torch.cuda.is_available())
    if os.environ.get("OMP_NUM_THREADS") or on_gpu:
        return None
    default, cores, load = torch.get_num_threads(), _cores(), os.getloadavg()[0]
    threads = free_core_threads(cores, load, default)
    torch.set_num_threads(threads)
    why = f"the load average {load:.1f} leaves {max(0, cores - int(load + 0.5))} of {plural(cores, 'core')} free"
    return f"meshtron: {plural(threads, 'torch thread')} ({why}; OMP_NUM_THREADS=N sets it)"
