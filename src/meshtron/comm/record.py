"""Flight recorder: what every rank was last doing on each group, for the message of a hang.

Every collective the comm layer issues bumps its group's sequence number on this rank (point-to-point
sends and receives are remembered as the last operation but not numbered: pipeline stages do different
numbers of them). A daemon thread publishes this rank's counters, its last operation per group and the
collective it is waiting in, if any, to the job's key-value store (the one the process group was built
on) whenever they change, at most once per `interval`. When a wait times out, the rank publishes its
own state at once, gives the others a moment to publish theirs, and reads every member of the group:

  - a rank waiting in the same collective number is in step with it;
  - a rank that issued fewer collectives on the group fell behind: it skipped that collective or has not
    reached it (still computing, stuck elsewhere, or dead);
  - a rank with no state never communicated (or its process is gone).

This is PyTorch's flight recorder idea (a ring of recent collectives per rank) reduced to what names the
culprit, and put in the error message rather than in dump files. `CommStats` is the other record: bytes
and calls per group and collective, for the step's metrics and the checks against theory.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

POINT_TO_POINT = ("send", "recv")
_KEY = "meshtron/flight/{rank}"


class _Lane(threading.local):
    """Whether this thread issues on the pair lane (collectives.py `Comm.pair_lane`): its collectives go to
    twin groups, which the recorder numbers apart, as "<group>~pair"."""

    pair = False


LANE = _Lane()


def flight_name(group: str) -> str:
    """The name the recorder numbers this thread's collectives on `group` under."""
    return f"{group}~pair" if LANE.pair else group


class FlightRecorder:
    """This process's record; one per process, shared by every Comm (see `recorder`)."""

    def __init__(self) -> None:
        self.store: Any = None
        self.rank = 0
        self.interval = 1.0
        self.issued: dict[str, int] = defaultdict(int)
        self.last: dict[str, tuple[str, float]] = {}
        self._waiting: dict[int, tuple[str, str, int]] = {}  # per thread: (op, group, number)
        self._published: str | None = None
        self._thread: threading.Thread | None = None

    def attach(self, store: Any, rank: int) -> None:
        """Publish to `store` (the job's store) from now on, as `rank`."""
        self.store, self.rank = store, rank
        if self._thread is None:
            self._thread = threading.Thread(target=self._publish_forever, daemon=True, name="meshtron-flight")
            self._thread.start()

    def note(self, group: str, op: str, nbytes: float) -> None:
        name = flight_name(group)
        if op not in POINT_TO_POINT:
            self.issued[name] += 1
        self.last[name] = (op, nbytes)

    def begin_wait(self, op: str, group: str) -> None:
        name = flight_name(group)
        self._waiting[threading.get_ident()] = (op, name, self.issued[name])

    def end_wait(self) -> None:
        self._waiting.pop(threading.get_ident(), None)

    def state(self) -> str:
        waiting = sorted(self._waiting.values())
        return json.dumps({"issued": self.issued, "last": self.last, "waiting": waiting}, sort_keys=True)

    def publish(self) -> None:
        state = self.state()
        if self.store is not None and state != self._published:
            self.store.set(_KEY.format(rank=self.rank), state)
            self._published = state

    def _publish_forever(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store is gone with its job: nothing left to record
                self._published = None

    def report(self, op: str, group: str, ranks: tuple[int, ...]) -> str:
        """What every rank of `group` was doing, and which fell behind (called on a timed-out wait)."""
        if self.store is None:
            return ""
        self.publish()
        time.sleep(2 * self.interval + 0.2)  # the others' threads publish what changed meanwhile
        group = flight_name(group)
        seq = self.issued[group]
        lines, behind = [f"what each rank of '{group}' was doing (as of the last {self.interval:.0f}s):"], []
        for rank in ranks:
            state = self._read(rank)
            if state is None:
                lines.append(f"  rank {rank}: no record (it never communicated, or its process is gone)")
                behind.append(rank)
                continue
            issued = state["issued"].get(group, 0)
            last = state["last"].get(group)
            waits = [f"{w[0]} #{w[2]} on '{w[1]}'" for w in state["waiting"]]
            doing = f"waiting in {' and '.join(waits)}" if waits else "not waiting in any collective"
            tail = f"; last on '{group}': {last[0]} moving {last[1]:.0f} B" if last else ""
            lines.append(f"  rank {rank}: {doing}; {issued} collectives issued on '{group}'{tail}")
            if issued < seq:
                behind.append(rank)
        if behind:
            lines.append(
                f"rank(s) {behind} fell behind on '{group}': they never issued {op} #{seq} there (skipped "
                "it, still computing, stuck elsewhere, or dead)"
            )
        return "\n".join(lines)

    def _read(self, rank: int) -> dict[str, Any] | None:
        key = _KEY.format(rank=rank)
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - an unreachable store is reported as "no record"
            return None


_RECORDER = FlightRecorder()


def recorder() -> FlightRecorder:
    return _RECORDER


@dataclass
class CommStats:
    """Bytes and calls per (group, collective), since the last `reset`."""

    bytes: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # Of the all-to-alls' bytes, those sent to a rank on another node (CountedCollectives.ranks_per_node).
    network: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Two threads count at once while a pipeline runs a DualPipeV pair's forward and backward together.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, group: str, op: str, nbytes: float, issued: bool = True, calls: int = 1) -> None:
        """`issued`: the call starts now (the flight recorder counts it); False books one to come.
        `calls`: how many calls the bytes stand for (0: bytes of calls no one can count, e.g. traced)."""
        with self._lock:
            self.bytes[(group, op)] += nbytes
            self.calls[(group, op)] += calls
            if issued:
                recorder().note(group, op, nbytes)

    def total_bytes(self, group: str | None = None, op: str | None = None) -> float:
        return sum(b for (g, o), b in self.bytes.items() if group in (None, g) and op in (None, o))

    def total_calls(self, group: str | None = None, op: str | None = None) -> int:
        return sum(c for (g, o), c in self.calls.items() if group in (None, g) and op in (None, o))

    def by_group(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (g, _), b in self.bytes.items():
            out[g] += b
        return dict(out)

    def calls_by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (g, _), c in self.calls.items():
            out[g] += c
        return dict(out)

    def record_network(self, group: str, nbytes: float) -> None:
        with self._lock:
            self.network[group] += nbytes

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.network.clear()

    def merge(self, other: CommStats) -> None:
        """Add `other`'s counts to these (an enclosing recording's; nothing is noted twice)."""
        with self._lock:
            for key, nbytes in other.bytes.items():
                self.bytes[key] += nbytes
            for key, calls in other.calls.items():
                self.calls[key] += calls
            for group, nbytes in other.network.items():
                self.network[group] += nbytes


Span = tuple[str, str, str, float, float]  # a wait: (op, group name, lane, start, end) in perf_counter s


@dataclass
class Recording:
    """What `Comm.recording` counted."""

    stats: CommStats
    spans: list[Span] | None = None
