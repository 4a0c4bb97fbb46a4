"""The reference peak FLOP/s that MFU divides by, and how an MFU is shown.

  GPU   the datasheet's dense bf16 tensor-core peak of the detected model, from the planner's table
        (plan/hardware.py ACCELERATORS, mapped from the device name as `meshtron train --dry-run` maps it);
        a GPU the table does not hold (or a PCIe / NVL board, whose clocks differ) has none: MFU n/a
  CPU   no datasheet figure fits a BLAS build, so the rate is measured: the best of several warm calls of
        a 1024 x 1024 matrix multiply in the training dtype with this process's threads. A rate measured
        while the machine was busy is too low and would put MFU above 100%, so the best figure ever
        measured is cached per machine, thread count and dtype (with the load average it was taken at)
        and reused by every later run (beside the hardware probe's cache: `$MESHTRON_CACHE`,
        `$XDG_CACHE_HOME/meshtron` or `~/.cache/meshtron`, file peak-flops.json). A process of T threads
        can do at least what one of fewer does, so its reference is the best figure of T threads *or
        fewer*: a busy two-thread probe (issue 45: 31.9 GFLOP/s, where one thread had 82.6) is neither
        believed nor written. A measurement only ever raises it: `MESHTRON_REPROBE=1` measures again at
        start-up, and a step that beats the reference (MFU above 100%) measures again on the spot.

An MFU above 100% means the reference is wrong, not the model fast: it is never shown as a number (the
metrics row has `mfu: null` and a note, the console says why).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.utils.words import plural

CACHE_FILE = "peak-flops.json"
METHOD = "best of 5 x 3 warm 1024x1024 matmuls"  # part of the cache key: a new method measures again
OVER_100 = ">100% (reference rate too low: machine busy at start-up? rerun with MESHTRON_REPROBE=1)"
_MEMO: dict[str, tuple[float, int]] = {}  # this process's figures: a test process builds hundreds of trainers
_MEASURED_AGAIN: set[str] = set()  # keys measured again in this process (cpu_peak_beaten)


def gpu_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The datasheet dense peak of this CUDA device and where it comes from (NaN when unknown)."""
    from meshtron.plan.hardware import ACCELERATORS, table_name

    props = torch.cuda.get_device_properties(device)
    name = table_name(props.name, props.total_memory)
    if name is None:
        return float("nan"), f"no datasheet peak for {props.name!r} (known: {', '.join(ACCELERATORS)})"
    peak = ACCELERATORS[name].bf16_flops_per_s
    source = f"{name}'s datasheet dense bf16 peak, {peak / 1e12:,.0f} TFLOP/s"
    if dtype != torch.bfloat16:  # the table holds tensor-core peaks only; fp32 matmuls stay below them
        source += f" (this run computes in {str(dtype).removeprefix('torch.')}, which cannot reach it)"
    return peak, source


def measure_matmul_rate(
    dtype: torch.dtype, n: int = 1024, rounds: int = 5, calls: int = 3, budget_s: float = 3.0
) -> float:
    """FLOP/s of the fastest of `rounds` x `calls` warm n x n matmuls: the best call is the one the other
    processes of a busy machine disturbed least. A dtype this CPU multiplies slowly (bf16 without bf16
    units: 0.8 GFLOP/s on an EPYC here, 40x below fp32, so 17 calls of n = 1024 took 48 s) is measured on
    the largest square, halving n, whose calls a 256 x 256 call's time says fit in `budget_s`."""
    small = torch.randn(256, 256, dtype=dtype)
    torch.mm(small, small)
    start = time.perf_counter()
    torch.mm(small, small)
    per_small_s = time.perf_counter() - start
    while n > 256 and per_small_s * (n / 256) ** 3 * (rounds * calls + 2) > budget_s:
        n //= 2
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):  # warm: BLAS threads started, caches and packing buffers allocated
        torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        for _ in range(calls):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        time.sleep(0.01)  # rounds spread out: another process's burst rarely covers them all
    return 2.0 * n**3 / best


def _cache() -> tuple[Any, str]:
    """(the cache file, this machine's key prefix), as the hardware probe keys its measurements."""
    from meshtron.probe import hardware as hardware_probe

    machine = f"{socket.gethostname()}|{hardware_probe.cpu_model()}|{os.cpu_count()} cpus"
    return hardware_probe.cache_path().parent / CACHE_FILE, f"{machine}|torch {torch.__version__}"


def _cached_rate(data: dict[str, Any], key: str) -> float | None:
    entry = data.get(key)
    rate = entry.get("flops_per_s") if isinstance(entry, dict) else None
    return rate if isinstance(rate, float) else None


def _best_cached(path: Any, dtype: torch.dtype, threads: int) -> tuple[float, int] | None:
    """(the best figure cached for `threads` threads or fewer, its thread count), or None."""
    from meshtron.probe import hardware as hardware_probe

    data = hardware_probe._read_cache(path)
    found = [(rate, t) for t in range(1, threads + 1) if (rate := _cached_rate(data, _cpu_key(dtype, t)[1]))]
    return max(found) if found else None


def _keep_best(path: Any, dtype: torch.dtype, threads: int, rate: float) -> tuple[float, int]:
    """(the best of `rate`, measured with `threads` threads, and the figures cached for that many or
    fewer, its thread count); `rate` is written back (atomically, as the probe writes: another process
    may be reading the file) only when it beats them all."""
    from meshtron.probe import hardware as hardware_probe

    best = _best_cached(path, dtype, threads)
    if best is not None and best[0] >= rate:
        return best
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = hardware_probe._read_cache(path)
        data[_cpu_key(dtype, threads)[1]] = {
            "flops_per_s": rate,
            "threads": threads,
            "load_average": os.getloadavg()[0],  # what else ran: a figure taken under load is low
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only home: the figure still serves this run
        pass
    return rate, threads


def _cpu_key(dtype: torch.dtype, threads: int | None = None) -> tuple[Any, str, str]:
    """(the cache file, the key of `threads`' figure (default: this process's), the source's words)."""
    threads = torch.get_num_threads() if threads is None else threads
    name = str(dtype).removeprefix("torch.")
    path, machine = _cache()
    source = f"this CPU's measured {name} matmul rate with {plural(threads, 'thread')}"
    return path, f"{machine}|{threads} threads|{name}|{METHOD}", source


def _figure(rate: float, threads: int) -> str:
    """A reference's GFLOP/s, with the thread count it was measured at when fewer than this process's."""
    fewer = (
        f" (measured with {threads}: no faster figure with more yet)"
        if threads < torch.get_num_threads()
        else ""
    )
    return f"{rate / 1e9:,.1f} GFLOP/s{fewer}"


def cpu_peak(dtype: torch.dtype, reprobe: bool | None = None) -> tuple[float, str]:
    """This CPU's best matmul rate with this process's threads (or fewer): cached, or measured now
    (`reprobe`, or nothing cached) and kept if it is the best yet."""
    if reprobe is None:
        reprobe = os.environ.get("MESHTRON_REPROBE", "") not in ("", "0")
    path, key, source = _cpu_key(dtype)
    if not reprobe and key in _MEMO:
        return _MEMO[key][0], f"{source}, {_figure(*_MEMO[key])} (cached in {path})"
    cached = None if reprobe else _best_cached(path, dtype, torch.get_num_threads())
    if cached is not None:
        _MEMO[key] = cached
        return cached[0], f"{source}, {_figure(*cached)} (cached in {path})"
    best = _MEMO[key] = _keep_best(path, dtype, torch.get_num_threads(), measure_matmul_rate(dtype))
    return best[0], f"{source}, {_figure(*best)} (best measured, cached in {path})"


def cpu_peak_beaten(dtype: torch.dtype, reference: float) -> tuple[float, str]:
    """A step ran faster than `reference` allows: measure again now (this rank alone; no collective) and
    keep the best of the two and the cache. Once per process: where a training step beats every matmul
    the probe times (bf16 on a CPU without bf16 units, whose small matmuls run 3x faster than 1024 x 1024
    ones), measuring at every step would add the measurement's seconds to each. The MFU shown stays
    honest either way: above 100% it is a note, not a number."""
    path, key, source = _cpu_key(dtype)
    threads = torch.get_num_threads()
    best = (reference, threads)
    if key not in _MEASURED_AGAIN:
        _MEASURED_AGAIN.add(key)
        best = max(best, _keep_best(path, dtype, threads, measure_matmul_rate(dtype)))
    _MEMO[key] = best
    return (
        best[0],
        f"{source}, {_figure(*best)} (measured again when a step beat the reference; {path})",
    )


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one device for the training dtype, and where the figure comes from."""
    return gpu_peak(device, dtype) if device.type == "cuda" else cpu_peak(dtype)


def job_peak_flops(
    device: torch.device, dtype: torch.dtype, comm: Comm, world: CommGroup
) -> tuple[float, str]:
    """Rank 0's `peak_flops`, on every rank: on a CPU the others wait (idle in the collective) while it
    measures, so that the measurement does not share the cores with them, and every rank's MFU has the
    same reference."""
    mine = peak_flops(device, dtype) if world.rank == 0 else None
    return comm.all_gather_object(mine, world)[0]


def shown_mfu(mfu: float) -> tuple[float | None, str | None]:
    """(the MFU a metrics row records, a note when it is not a number): None with the reason when the
    reference is unknown, or when the MFU is above 100% (the reference was measured too low)."""
    if mfu != mfu:  # NaN: no reference peak
        return None, "n/a"
    if mfu > 1.0:
        return None, OVER_100
    return mfu, None


def format_mfu(mfu: float | None, note: str | None = None) -> str:
    """A row's MFU for the console: a percentage, or the note why there is none."""
    return f"{100 * mfu:.1f}%" if mfu is not None else (note or "n/a")
