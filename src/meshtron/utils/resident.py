"""This process's resident peak, measured so that it is this process's own; the host's memory; handing
the memory malloc keeps after frees back to the system.

`getrusage`'s ru_maxrss survives exec: in a process started by spawn (a test worker, a launched rank) it
is at least the parent's resident size at the fork (an 800 MB test runner makes every worker's peak
800 MB). On Linux the peak is read from /proc's VmHWM instead, which belongs to the process's own
address space.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
from pathlib import Path


def resident_peak_bytes() -> int:
    """This process's largest resident size so far, in bytes."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, others KiB


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit when lower (a container sees the host's RAM)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            total = min(total, int(Path(limit).read_text().strip()))
    return int(total)


def release_freed_memory() -> None:
    """Return to the system the pages glibc's malloc keeps after frees (`malloc_trim`): its arenas hold
    freed chunks for reuse, so a phase whose temporaries are gone (start-up's) stays resident until
    the process reuses them. A no-op off Linux and where the C library has no malloc_trim (musl)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
