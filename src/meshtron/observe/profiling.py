"""Profiler traces of chosen steps on every rank, their merged timeline, and the memory each phase held.

`profile.steps = [first, last]` (or `meshtron train --profile-steps first,last`) records steps first..last
(1-based, as the metrics count them) with `torch.profiler` on every rank, after a barrier so that the
ranks start together. While recording, the step's phases, every pipeline action and every collective
wait are named spans (comm/timing.py): "forward micro-batch 0", "backward chunk 1 micro-batch 3", "send
gradients chunk 2 micro-batch 0 to rank 1", "all_reduce on dp". Written into `<run.dir>/traces/`:

  rank-NNNNN.json          each rank's Chrome trace (Perfetto, chrome://tracing)
  merged.json              every rank on one timeline, a process per rank (traces.py)
  memory-rank-NNNNN.pickle on CUDA with profile.memory_history: the caching allocator's history of those
                           steps (open it in pytorch.org/memory_viz; cuda_memory.py)

With memory profiling on, each rank finds its peak bytes per phase in its trace (traces.py); rank 0 puts
every rank's, and the planner's prediction for its stage, in the run summary (`memory_by_phase`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.timing import PHASES, TIMES
from meshtron.config.layout import Dim
from meshtron.config.schema import Config
from meshtron.engines.staging import Staging
from meshtron.observe import cuda_memory
from meshtron.observe.metrics import storage_bytes
from meshtron.observe.traces import ALIGN, memory_peaks, merge_traces, rank_trace_name
from meshtron.plan.gpu_memory import MemoryOverhead, stage_memory


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of the distinct storages behind this rank's parameters (and the shards its optimizer
    steps), gradients, buffers and optimizer state: what a CPU rank holds before a profiled window (the
    CPU profiler counts from its start)."""
    optimized = [p for group in optimizer.param_groups for p in group["params"]]  # ZeRO: the shards
    tensors = [*model.parameters(), *model.buffers(), *optimized]
    tensors += [p.grad for p in [*model.parameters(), *optimized] if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return float(storage_bytes([t for t in tensors if t.device.type != "meta"]))


def staging_bytes(engine: Any) -> float:
    """Bytes of the persistent communication buffers (engines/staging.py) the data-parallel engine
    holds, found among its attributes and its parts' (a few levels down)."""
    seen, found = set(), {}

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, Staging):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif type(obj).__module__.startswith("meshtron.") and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item, depth + 1)

    visit(engine, 0)
    buffers = [b for s in found.values() for kept in s.buffers.values() for b in kept]
    return float(sum(b.numel() * b.element_size() for b in buffers))


class StepProfiler:
    """Records profile.steps on this rank; `before(step)` and `after(step)` around every step (1-based)."""

    def __init__(self, steps: list[int], run_dir: Path, device: torch.device, memory_history: bool):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = run_dir / "traces"
        self.device = device
        self.memory_history = memory_history and device.type == "cuda"
        self.prof: profile | None = None
        self.held_at_start = 0.0  # bytes allocated when the window opened
        self.base_bytes = 0.0  # what the profiler's totals leave out: the CPU's count from the window's start
        self.peaks_by_rank: list[dict[str, float]] | None = None  # every rank's, once recorded

    def recording(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before(self, step: int, comm: Comm, world: CommGroup, held: Callable[[], float]) -> None:
        """Start recording at the first profiled step (collective: a barrier lines the ranks up).
        `held()`: the bytes this rank holds now (`held_bytes`)."""
        if step != self.first:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        if self.memory_history:
            cuda_memory.start_history()
        self.held_at_start = float(torch.cuda.memory_allocated(self.device)) if cuda else held()
        self.base_bytes = 0.0 if cuda else self.held_at_start
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(activities=activities, profile_memory=True)
        self.prof.__enter__()
        TIMES.tracing, TIMES.span_phases = True, {}
        comm.barrier(world)
        with record_function(ALIGN):  # the instant every rank left the barrier (traces.py aligns on it)
            pass

    def after(
        self,
        step: int,
        comm: Comm,
        world: CommGroup,
        predicted: Callable[[], dict[str, float]],
        buffers: float,
    ) -> None:
        """Stop at the last profiled step: write this rank's trace (and memory history), find its peaks
        per phase, gather every rank's with the planner's `predicted()` parts; rank 0 merges the traces
        (collective). `buffers`: the bytes of the engine's communication buffers (`staging_bytes`)."""
        if step != self.last or self.prof is None:
            return
        TIMES.tracing = False
        self.prof.__exit__(None, None, None)
        rank = world.rank
        path = self.dir / rank_trace_name(rank)
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        if self.memory_history:
            cuda_memory.dump_history(self.dir / f"memory-rank-{rank:05d}.pickle")
        device_type = 1 if self.device.type == "cuda" else 0
        peaks = memory_peaks(path, TIMES.span_phases, device_type, self.base_bytes)
        peaks["held_at_start"] = self.held_at_start
        peaks["communication_buffers"] = buffers
        self.peaks_by_rank = comm.all_gather_object({"measured": peaks, "planner": predicted()}, world)
        if rank == 0:
            paths = [self.dir / rank_trace_name(r) for r in range(world.size)]
            # What each rank's CPU totals leave out (a GPU's are whole): its memory counter adds it.
            bases = [r["measured"]["held_at_start"] * (device_type == 0) for r in self.peaks_by_rank]
            merged = merge_traces(paths, self.dir / "merged.json", device_type, bases)
            print(
                f"meshtron: traces of steps {self.first}-{self.last} in {self.dir} (merged: {merged.name}; "
                "open in ui.perfetto.dev)",
                flush=True,
            )


def predicted_memory(cfg: Config, place: Any) -> dict[str, float]:
    """The planner's bytes by part for this rank's pipeline stage (plan/gpu_memory.py), without the
    CUDA context and fragmentation it adds for a GPU: what the tensors themselves should take."""
    overhead = MemoryOverhead(
        context_bytes=0.0, fragmentation=0.0, in_place_reduce=place.device.type == "cpu"
    )
    parallel = dataclasses.replace(cfg.parallel, dp_shard=cfg.parallel.dp_shard_for(place.world_size))
    cfg = dataclasses.replace(cfg, parallel=parallel)  # the planner takes explicit degrees
    parts = stage_memory(cfg, place.world_size, place.mesh.local_rank(Dim.PP), None, overhead)
    parts.pop("reserved", None)
    return {**parts, "total": sum(parts.values())}


def memory_line(by_rank: list[dict[str, Any]]) -> str:
    """The console's line: the rank with the largest measured peak, per phase, against the planner."""
    rank = max(range(len(by_rank)), key=lambda r: by_rank[r]["measured"].get("peak", 0.0))
    measured, planner = by_rank[rank]["measured"], by_rank[rank]["planner"]
    phases = ", ".join(f"{p} {measured[p] / 2**20:,.1f}" for p in (*PHASES, "other") if p in measured)
    return (
        f"meshtron: memory of the profiled steps, rank {rank} (the largest): peak {measured.get('peak', 0) / 2**20:,.1f} "
        f"MiB ({phases}; held at the start {measured['held_at_start'] / 2**20:,.1f}); the planner predicts "
        f"{planner['total'] / 2**20:,.1f} MiB for its stage"
    )
