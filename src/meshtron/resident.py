"""This process's resident peak, measured so that it is this process's own.

`getrusage`'s ru_maxrss survives exec: in a process started by spawn (a test worker, a launched rank) it
is at least the parent's resident size at the fork (an 800 MB test runner makes every worker's peak
800 MB). On Linux the peak is read from /proc's VmHWM instead, which belongs to the process's own
address space.
"""

from __future__ import annotations

import resource
import sys


def resident_peak_bytes() -> int:
    """This process's largest resident size so far, in bytes."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, others KiB
