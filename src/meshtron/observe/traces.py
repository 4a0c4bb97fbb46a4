"""Reading the profiler's Chrome traces: one merged timeline of every rank, and the peak memory per phase.

Merging. Each rank's trace (`rank-NNNNN.json`, what `torch.profiler` exports) has its own process id
and clock. The merged trace gives rank r's host events process id 100·r (its GPU streams 100·r + 1, 2,
... in the order they appear) named "rank r" ("rank r: GPU stream ..."), and shifts every rank's
timestamps so that its `ALIGN` span, recorded by every rank right after a barrier, starts at the same
instant as rank 0's: one timeline for the whole mesh even when the hosts' clocks differ. Flow ids are
made unique per rank, and each rank's memory becomes a counter track ("allocated MiB": the memory
timeline, next to the phases). Perfetto (ui.perfetto.dev) and chrome://tracing open both kinds of file.

Memory. With `profile_memory`, every allocation and free is an instant event carrying the allocator's
total. On a GPU that total is what the caching allocator has handed out; on the CPU it counts only what
was allocated since the profiler started, so the caller adds the bytes the rank held before (its
parameters, gradients, optimizer state). Each event counts in the phase whose span (comm/timing.py) holds
its timestamp, innermost first; "other" is anything outside every phase (data, the loss's reduction).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

ALIGN = "meshtron: ranks aligned"
MEMORY = "[memory]"


def rank_trace_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _events(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["traceEvents"]


def _align_ts(events: list[dict[str, Any]]) -> float:
    return next((e["ts"] for e in events if e.get("name") == ALIGN and e.get("ph") == "X"), 0.0)


def merge_traces(
    paths: list[Path], out: Path, device_type: int = 0, memory_bases: list[float] | None = None
) -> Path:
    """One Chrome trace of `paths` (rank order), a process per rank and device, on one clock, with each
    rank's allocated bytes on `device_type` (0 CPU, 1 CUDA) as a counter track, its base added
    (`memory_bases`: what a CPU rank held before the profiler started)."""
    merged: list[dict[str, Any]] = []
    origin = None
    for rank, path in enumerate(paths):
        events = _events(path)
        aligned = _align_ts(events)
        origin = aligned if origin is None else origin
        shift = origin - aligned
        pids: dict[Any, int] = {}
        host = next((e["pid"] for e in events if e.get("cat") == "user_annotation"), None)
        for e in events:
            pid = e.get("pid")
            if not isinstance(pid, int):
                continue  # the profiler's own bookkeeping rows
            if pid not in pids:
                pids[pid] = 100 * rank + (0 if pid == host else 1 + len([p for p in pids if p != host]))
                label = f"rank {rank}" if pid == host else f"rank {rank}: device {pid}"
                merged.append(_meta("process_name", pids[pid], {"name": label}))
                merged.append(_meta("process_sort_index", pids[pid], {"sort_index": pids[pid]}))
            if e.get("ph") == "M" and e.get("name") in (
                "process_name",
                "process_sort_index",
                "process_labels",
            ):
                continue
            e = {**e, "pid": pids[pid]}
            if "ts" in e:
                e["ts"] = e["ts"] + shift
            if isinstance(e.get("id"), int):
                e["id"] = (rank << 40) + e["id"]
            merged.append(e)
            args = e.get("args") or {}
            if e.get("name") == MEMORY and args.get("Device Type") == device_type:
                base = memory_bases[rank] if memory_bases else 0.0
                total = float(args.get("Total Allocated", 0)) + base
                merged.append(
                    {
                        "name": "allocated MiB",
                        "ph": "C",
                        "ts": e["ts"],
                        "pid": 100 * rank,
                        "args": {"allocated": total / 2**20},
                    }
                )
    out.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return out


def _meta(name: str, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": 0, "args": args}


def memory_peaks(
    path: Path, span_phases: dict[str, str], device_type: int, base_bytes: float
) -> dict[str, float]:
    """{phase: peak bytes} of one rank's trace, plus "peak" over the whole window. `span_phases`: each
    span name's phase; `device_type` 0 CPU, 1 CUDA; `base_bytes`: added to every total (CPU)."""
    events = _events(path)
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0), span_phases[e["name"]])
        for e in events
        if e.get("ph") == "X" and e.get("name") in span_phases
    )
    starts = [s[0] for s in spans]
    reach, furthest = [], float("-inf")  # reach[i]: the latest end among spans 0..i
    for _, end, _ in spans:
        furthest = max(furthest, end)
        reach.append(furthest)
    peaks: dict[str, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("name") != MEMORY or args.get("Device Type") != device_type:
            continue
        total = float(args.get("Total Allocated", 0)) + base_bytes
        phase = _phase_at(spans, starts, reach, e["ts"])
        peaks[phase] = max(peaks.get(phase, 0.0), total)
        peaks["peak"] = max(peaks.get("peak", 0.0), total)
    return peaks


def _phase_at(
    spans: list[tuple[float, float, str]], starts: list[float], reach: list[float], ts: float
) -> str:
    """The innermost phase span holding `ts`: the latest-starting one that has not ended by then."""
    i = bisect.bisect_right(starts, ts) - 1
    while i >= 0 and reach[i] >= ts:  # some span up to i may still hold ts
        if spans[i][1] >= ts:
            return spans[i][2]
        i -= 1
    return "other"
