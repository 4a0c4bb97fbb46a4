"""Where this rank's time goes: compute per phase and time blocked in collectives per group.

The training step marks its phases (`TIMES.phase`) and the comm layer reports every wait
(`TIMES.waited`); the straggler report (observe/stragglers.py) gathers the sums once per log interval.

  phase       what runs in it                                           marked in
  forward     the model's forward and the loss (a pipeline's F)         parallel/parallelize.py, pipeline/runtime.py
  backward    backward (a pipeline's B and W), the gradient sync's wait  the same, and train/trainer.py
  optimizer   clipping, the optimizer step, ZeRO's post-step gathers     train/trainer.py

A phase's compute time is its wall time, exclusive of phases nested in it, minus the waits inside it.
Waits count per group whatever phase they fall in. Time points are `time.perf_counter()` on the CPU; on
a GPU they are CUDA events on the current stream (the host runs ahead of the device, so host clocks
would time kernel launches): a wait is then the time the stream sat blocked behind the collective.
Events are read back in `settle()` once complete (the trainer calls it after each step); the straggler
report's `take()` waits for the rest: one synchronisation per log interval.

The same marks name the spans of a profiler trace (observe/profiling.py): each phase and each pipeline
action is a `torch.profiler.record_function` span while a trace is being recorded (`tracing`), and every
wait a span named after its collective and group ("all_reduce on dp").
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("forward", "backward", "optimizer")
SLOW_RANK = "MESHTRON_SLOW_RANK"  # "RANK:SECONDS": that rank sleeps in every forward (straggler drills)


class _Stack(threading.local):
    """This thread's open phases, innermost last (a pipeline pair's forward runs in a second thread)."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.since: Any = None  # where the innermost phase's current segment started


class PhaseTimes:
    """This process's record (one, `TIMES`): compute seconds per phase, wait seconds per group."""

    def __init__(self) -> None:
        self.cuda = False  # time points as CUDA events (`use_device`)
        self.tracing = False  # a profiler is recording: phases and waits become named spans
        self.span_phases: dict[str, str] = {}  # while tracing: each phase span's name -> its phase
        self._stack = _Stack()
        self._pending: list[tuple[str, str, Any, Any]] = []  # (kind, key, start, end) not yet in seconds
        self.compute: dict[str, float] = defaultdict(float)
        self.waits: dict[str, float] = defaultdict(float)

    def use_device(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def current(self) -> str | None:
        return self._stack.open[-1] if self._stack.open else None

    @contextlib.contextmanager
    def phase(self, name: str, span: str | None = None) -> Iterator[None]:
        """Time the block as phase `name` (exclusive of phases opened inside it); `span`: the profiler
        span's name, when it says more than the phase's (a pipeline action)."""
        here = self._stack
        outer, start = self.current(), self.mark()
        if outer is not None:
            self._pending.append(("compute", outer, here.since, start))
        here.open.append(name)
        here.since = start
        if self.tracing:
            self.span_phases[span or name] = name
        with self.span(span or name):
            if name == "forward" and (slow := _slow_seconds()):
                time.sleep(slow)
            try:
                yield
            finally:
                end = self.mark()
                self._pending.append(("compute", name, here.since, end))
                here.open.pop()
                here.since = end

    def span(self, name: str) -> contextlib.AbstractContextManager:
        """A profiler span while tracing; nothing otherwise (a span costs a dispatcher call)."""
        return torch.profiler.record_function(name) if self.tracing else contextlib.nullcontext()

    def waited(self, group: str, start: Any, end: Any) -> None:
        """A wait on `group` between two `mark()`s: the group's, and not its phase's compute."""
        self._pending.append(("wait", group, start, end))
        if self.current() is not None:
            self._pending.append(("waited_in", self.current(), start, end))

    def settle(self, wait: bool = False) -> None:
        """Turn the recorded time points into seconds: on a GPU those whose events have completed (all
        of them, waiting for the device, with `wait`)."""
        pending, self._pending = self._pending, []
        for kind, key, start, end in pending:
            if self.cuda and not wait and not (start.query() and end.query()):  # (two streams: either last)
                self._pending.append((kind, key, start, end))
                continue
            if self.cuda:
                start.synchronize()
                end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            if kind == "wait":
                self.waits[key] += seconds
            else:
                self.compute[key] += seconds if kind == "compute" else -seconds

    def take(self) -> dict[str, dict[str, float]]:
        """{"compute": {phase: s}, "waits": {group: s}} since the last take, and start afresh."""
        self.settle(wait=True)
        out = {"compute": dict(self.compute), "waits": dict(self.waits)}
        self.compute.clear()
        self.waits.clear()
        return out


def _slow_seconds() -> float:
    """This rank's sleep per forward under MESHTRON_SLOW_RANK, else 0."""
    asked = os.environ.get(SLOW_RANK, "")
    if ":" not in asked:
        return 0.0
    rank, seconds = asked.split(":", 1)
    me = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return float(seconds) if rank.strip() == str(me) else 0.0


TIMES = PhaseTimes()
