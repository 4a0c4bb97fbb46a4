"""This machine as the planner's cluster, measured on the spot: `meshtron plan --gpu cpu --gpus N`.

The N "GPUs" are N gloo processes on this machine's cores as `meshtron train --nproc N` starts them:
`OMP_NUM_THREADS` threads each (the launcher's default, max(1, cores // N)), possibly more ranks than
cores. So every figure is measured with all N ranks (a `WorkerPool`; collectives through meshtron.comm.collectives)
working at once, under the same sharing, and is a rate *per rank*: compute in a wall-clock window
started by a barrier (best-of-single-calls would catch moments when the other ranks happen to be
descheduled), collectives in fixed counts.

  figure              how (the demo's shapes: 512 rows, dim 256, FFN 688, vocab 4096)      becomes
  matmul FLOP/s       fp32 matmuls of 4 layers (q k v o, SwiGLU) and the head, forward and  fp32_ (and bf16_)
                      both backward products as autograd runs F.linear (x·Wᵀ, g·W, gᵀ·x)    flops_per_s
  attention share     SDPA forward + backward as the model calls it, in the planner's       efficiency
                      FLOPs (3 x 4·q·keys·rows, keys = s/2), over the matmul rate           .attention
  memory bytes/s      a 64 MiB copy (read + write)                                          hbm_bytes_per_s
  elementwise share   gradient norm and clipping, foreach AdamW, zeroing the gradients, in  efficiency.hbm
                      the planner's 32 bytes per parameter, over the copy's rate
  all-reduce, -gather a small and a 16 MiB tensor: latency a = t_small / hops, bus          link bandwidth:
                      bandwidth share·ΔS / Δt (plan/network.py's hops and shares)           all-gather's
  latency under load  ranks in pairs (0-1, 2-3, ...) run a SwiGLU forward then a tiny       the links'
                      all-reduce in the pair: the median of rounds, minus the forward's     latency
                      time in a window; per message
  pair exchange       the same pairs, each rank sending to and receiving from the other     p2p latency
                      after the forward (a ring hop, a pipeline boundary), at 4 KiB and     and bandwidth
                      512 KiB: alpha-beta of the two
  process size        a rank's resident memory after import and gloo init                   context_bytes
  memory              the host's RAM (or the cgroup's limit) / N                            memory_bytes

Choices, and why (checked by benchmarks/planner_cpu.py: RESULTS.md, "Planner on this CPU"):
- matmul efficiency 1.0: the rate is measured at the model's shapes, not a datasheet peak.
- hbm efficiency = the elementwise share, about 0.35: eager CPU kernels make several unfused passes
  where the planner's counts (4 trips per kept activation byte, 32 bytes per optimizer element) assume
  fused GPU kernels; measured on AdamW, the same factor fits the layers' elementwise work. With these,
  one rank's demo step is predicted within a few % of its measured CPU time (166 vs 169 ms; the demo
  with 4 experts 189 vs 218 ms: routing and permutation are not counted).
- The link bandwidth is all-gather's. The planner's formulas charge an all-gather or a reduce-scatter
  half an all-reduce's bytes; on gloo they cost about as much as one: its all-gather reaches about half
  the all-reduce's bus bandwidth, and a reduce-scatter is an all-reduce (comm/counted.py). An all-reduce is
  then charged about twice its time (DDP's gradients: a few % of the demo's step).
- The latency is the one under load: with more ranks than cores a message often waits until its
  receiver, descheduled in the middle of its compute, runs again (a scheduler time slice is ms). Here
  about 1-2 ms per message, noisy (it depends on how the scheduler phases the ranks), against 0.7 ms
  idle (only communicating); both are kept, and the idle one is the floor of the planner's.
- No overlap (`Overlap` all False): with ranks >= cores no core is idle, so gloo's threads (copies,
  reductions) take their time from compute rather than hiding behind it.
- Shared cores (`alone_speedup` = ranks·threads / cores when above 1): a rank idle in a pipeline's
  bubble, or on a lighter stage, leaves its core to the others, so a pipeline's step is bounded by its
  stages' mean work rather than by its busiest stage plus the bubble (plan/estimate.py).

The measurement is cached per machine (host, CPU model, core count, torch version), rank count, thread
count and probe sizes in `$MESHTRON_CACHE` (beside the prepared data), else `$XDG_CACHE_HOME/meshtron`
or `~/.cache/meshtron`, file `hardware-probe.json`; `MESHTRON_REPROBE=1` measures again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from meshtron.plan.comm_time import Overlap
from meshtron.plan.compute_time import ComputeEfficiency
from meshtron.plan.estimate import Cluster
from meshtron.plan.gpu_memory import MemoryOverhead
from meshtron.plan.hardware import Accelerator
from meshtron.plan.network import LinkEfficiency
from meshtron.probe.ranks import DEMO, ProbeSizes, rank_probe
from meshtron.probe.ranks import QUICK as QUICK  # re-exported: the probe for tests, a second or two
from meshtron.utils.cache import cache_dir
from meshtron.utils.resident import host_memory_bytes
from meshtron.utils.words import plural

CACHE_FILE = "hardware-probe.json"
PROBE_VERSION = 5  # bump when the method changes, so old cache entries are measured again


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """Per-rank figures of this machine with `ranks` ranks of `threads` threads (units: SI)."""

    ranks: int
    threads: int
    matmul_flops_per_s: float
    attention_share: float  # SDPA forward+backward rate (planner-counted FLOPs) / matmul rate
    memory_bytes_per_s: float  # a large copy, read + write
    elementwise_share: float  # the optimizer's rate (planner-counted bytes) / the copy's
    all_reduce_bytes_per_s: float  # bus bandwidth per rank
    all_reduce_latency_s: float  # per message
    all_gather_bytes_per_s: float
    all_gather_latency_s: float
    loaded_latency_s: float  # per message of a small all-reduce between compute (what training sees)
    p2p_latency_s: float  # a pair exchange between compute: latency and bandwidth
    p2p_bytes_per_s: float
    context_bytes: float  # a rank's resident memory before any work
    host_memory_bytes: int
    cpu: str
    measured_at: str
    probe_seconds: float


# -- in the parent --


def cpu_model() -> str:
    """This machine's processor, as /proc/cpuinfo (or the platform) names it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _alpha_beta(small: tuple, large: tuple, hops: int, share: float) -> tuple[float, float]:
    """(latency per message, bandwidth) from two timed sizes (bytes, seconds) of a collective whose
    time is hops·a + share·S / B (the alpha-beta model of plan/network.py)."""
    (s0, t0), (s1, t1) = small, large
    if t1 - t0 < t1 / 4:  # noise swamps the difference: take the large call's time as all bandwidth
        return t0 / hops, share * s1 / t1
    bandwidth = share * (s1 - s0) / (t1 - t0)
    return max(0.0, t0 - share * s0 / bandwidth) / hops, bandwidth


def launcher_threads(ranks: int) -> int:
    """Threads per rank as `meshtron train --nproc` sets them (cli._launch): the caller's
    OMP_NUM_THREADS if set, otherwise the cores shared out."""
    with contextlib.suppress(KeyError, ValueError):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // ranks)


def measure(ranks: int, threads: int, sizes: ProbeSizes = DEMO) -> Measurement:
    """Spawn `ranks` gloo processes of `threads` threads and measure them all at once."""
    from meshtron.comm.workers import WorkerPool

    start = time.perf_counter()
    pool = WorkerPool(ranks, timeout_s=120.0)
    try:
        per_rank = pool.run(rank_probe, threads, sizes)
    finally:
        pool.close()

    def mean(key: str) -> float:
        return sum(r[key] for r in per_rank) / ranks

    def slowest(key: str) -> float:  # a collective ends for all when it ends for the slowest
        return max(r[key] for r in per_rank)

    matmul, copy, n = mean("matmul"), mean("copy"), ranks
    p2p = (0.0, copy)  # one rank: never used
    if n > 1:
        p2p = _alpha_beta((4096, slowest("p2p_small")), (sizes.p2p_kib * 1024, slowest("p2p_large")), 1, 1.0)
    links = {"all_reduce": (0.0, copy), "all_gather": (0.0, copy)}  # one rank: never used
    for name, hops, share in (
        ("all_reduce", 2 * (n - 1), 2 * (n - 1) / n),
        ("all_gather", n - 1, (n - 1) / n),
    ):
        if n > 1:
            small, large = (
                (slowest(f"{size}_bytes"), slowest(f"{name}_{size}")) for size in ("small", "large")
            )
            links[name] = _alpha_beta(small, large, hops, share)
    return Measurement(
        ranks=ranks,
        threads=threads,
        matmul_flops_per_s=matmul,
        attention_share=mean("attention") / matmul,
        memory_bytes_per_s=copy,
        elementwise_share=mean("optimizer") / copy,
        all_reduce_bytes_per_s=links["all_reduce"][1],
        all_reduce_latency_s=links["all_reduce"][0],
        all_gather_bytes_per_s=links["all_gather"][1],
        all_gather_latency_s=links["all_gather"][0],
        loaded_latency_s=mean("loaded_latency") if n > 1 else 0.0,
        p2p_latency_s=p2p[0],
        p2p_bytes_per_s=p2p[1],
        context_bytes=slowest("context"),
        host_memory_bytes=host_memory_bytes(),
        cpu=f"{cpu_model()} ({os.cpu_count()} logical CPUs)",
        measured_at=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        probe_seconds=time.perf_counter() - start,
    )


def cluster_from(m: Measurement) -> Cluster:
    """The planner's cluster for a measurement (the module docstring says why each constant)."""
    gpu = Accelerator(
        name="cpu",
        bf16_flops_per_s=m.matmul_flops_per_s,  # a CPU rank trains in fp32; the planner reads fp32_*
        fp8_flops_per_s=None,
        fp32_flops_per_s=m.matmul_flops_per_s,
        memory_bytes=m.host_memory_bytes // m.ranks,
        hbm_bytes_per_s=m.memory_bytes_per_s,
        intra_node_bytes_per_s=m.all_gather_bytes_per_s,  # see the module docstring
        inter_node_bytes_per_s=m.all_gather_bytes_per_s,
        gpus_per_node=m.ranks,
        sources=(
            f"measured on {m.cpu}, {m.ranks} gloo ranks x {m.threads} threads at once, {m.measured_at}: "
            f"fp32 matmul {m.matmul_flops_per_s / 1e9:.1f} GFLOP/s, SDPA {m.attention_share:.2f} of it, "
            f"copy {m.memory_bytes_per_s / 1e9:.1f} GB/s (elementwise {m.elementwise_share:.2f} of it), "
            f"gloo all-reduce {m.all_reduce_bytes_per_s / 1e9:.2f} GB/s, all-gather "
            f"{m.all_gather_bytes_per_s / 1e9:.2f} GB/s, latency {m.loaded_latency_s * 1e6:.0f} us/message "
            f"under load, {m.all_reduce_latency_s * 1e6:.0f} idle (per rank), pair exchange "
            f"{m.p2p_bytes_per_s / 1e9:.2f} GB/s after {m.p2p_latency_s * 1e6:.0f} us"
        ),
    )
    # Waiting on a descheduled peer only adds to a message's idle cost: the idle latency is a floor
    # (the loaded figure is a difference of two noisy timings and can fall below it).
    latency = max(m.loaded_latency_s, m.all_reduce_latency_s)
    return Cluster(
        gpu,
        m.ranks,
        "fp32",
        compute=ComputeEfficiency(
            matmul=1.0, attention=m.attention_share, hbm=m.elementwise_share, matmul_fp8=1.0
        ),
        links=LinkEfficiency(
            nvlink=1.0,
            network=1.0,
            nvlink_latency_s=latency,
            network_latency_s=latency,
            p2p=m.p2p_bytes_per_s / m.all_gather_bytes_per_s,
            p2p_latency_s=m.p2p_latency_s,
        ),
        overlap=Overlap(**{f.name: False for f in fields(Overlap)}),
        memory=MemoryOverhead(context_bytes=m.context_bytes, in_place_reduce=True),
        alone_speedup=max(1.0, m.ranks * m.threads / _cores()),
    )


def _cores() -> int:
    """The cores this process may run on (its affinity; a container's CPU quota is not seen)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# -- the cache --


def cache_path() -> Path:
    """Where measurements are kept: beside the prepared data (meshtron/utils/cache.py)."""
    return cache_dir() / CACHE_FILE


def cache_key(ranks: int, threads: int, sizes: ProbeSizes) -> str:
    import torch

    machine = f"{socket.gethostname()}|{cpu_model()}|{os.cpu_count()} cpus|torch {torch.__version__}"
    return f"{machine}|{ranks} ranks|{threads} threads|{sizes.tag}"


def _read_cache(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        if isinstance(data := json.loads(path.read_text()), dict):
            return data
    return {}


def load_cached(key: str) -> Measurement | None:
    """The cached measurement, or None (none, another probe version's, or unreadable)."""
    entry = _read_cache(cache_path()).get(key)
    with contextlib.suppress(KeyError, TypeError, AttributeError):
        return Measurement(**entry["measurement"]) if entry.get("version") == PROBE_VERSION else None
    return None


def save_cached(key: str, m: Measurement) -> None:
    """Add or replace one entry, atomically (another process may be reading the file)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_cache(path)
    data[key] = {"version": PROBE_VERSION, "measurement": asdict(m)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def probe(ranks: int, sizes: ProbeSizes = DEMO, reprobe: bool | None = None) -> Measurement:
    """This machine's measurement for `ranks` ranks: cached, or measured now (and cached) when there is
    none, when `reprobe`, or when the environment says MESHTRON_REPROBE=1."""
    if ranks < 1:
        raise ValueError(f"a cluster needs at least 1 rank, got {ranks}")
    if reprobe is None:
        reprobe = os.environ.get("MESHTRON_REPROBE", "") not in ("", "0")
    threads = launcher_threads(ranks)
    key = cache_key(ranks, threads, sizes)
    if not reprobe and (cached := load_cached(key)) is not None:
        return cached
    # stderr: `meshtron plan --json` prints its answer on stdout
    print(
        f"meshtron: measuring this machine with {plural(ranks, 'rank')} x {plural(threads, 'thread')}...",
        file=sys.stderr,
    )
    m = measure(ranks, threads, sizes)
    save_cached(key, m)
    return m


def cpu_cluster(ranks: int, sizes: ProbeSizes = DEMO, reprobe: bool | None = None) -> Cluster:
    """This machine, measured on the spot (or from the cache), as a cluster of `ranks` gloo ranks."""
    return cluster_from(probe(ranks, sizes, reprobe))
