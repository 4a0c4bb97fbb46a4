"""The reference peak FLOP/s that MFU divides by, and how an MFU is shown.

  GPU   the datasheet's dense bf16 tensor-core peak of the detected model, from the planner's table
        (plan/hardware.py ACCELERATORS, mapped from the device name as `meshtron train --dry-run` maps it);
        a GPU the table does not hold (or a PCIe / NVL board, whose clocks differ) has none: MFU n/a
  CPU   no datasheet figure fits a BLAS build, so the rate is measured: the best of several warm calls of
        a 1024 x 1024 matrix multiply in the training dtype with this process's threads. A rate measured
        while the machine was busy is too low and would put MFU above 100%, so the best figure ever
        measured is cached per machine, thread count and dtype and reused by every later run (beside the
        hardware probe's cache: `$MESHTRON_CACHE`, `$XDG_CACHE_HOME/meshtron` or `~/.cache/meshtron`,
        file peak-flops.json). A measurement only ever raises it: `MESHTRON_REPROBE=1` measures again at
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

from meshtron.comm import Comm, CommGroup

CACHE_FILE = "peak-flops.json"
METHOD = "best of 5 x 3 warm 1024x1024 matmuls"  # part of the cache key: a new method measures again
OVER_100 = ">100% (reference rate too low: machine busy at start-up? rerun with MESHTRON_REPROBE=1)"
_MEMO: dict[str, float] = {}  # this process's figures: a test process builds hundreds of trainers


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


def measure_matmul_rate(dtype: torch.dtype, n: int = 1024, rounds: int = 5, calls: int = 3) -> float:
    """FLOP/s of the fastest of `rounds` x `calls` warm n x n matmuls: the best call is the one the other
    processes of a busy machine disturbed least."""
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
    from meshtron.plan import probe as hardware_probe

    machine = f"{socket.gethostname()}|{hardware_probe.cpu_model()}|{os.cpu_count()} cpus"
    return hardware_probe.cache_path().parent / CACHE_FILE, f"{machine}|torch {torch.__version__}"


def _keep_best(path: Any, key: str, rate: float) -> float:
    """The best of `rate` and the cached figure, written back (atomically, as the probe writes: another
    process may be reading the file)."""
    from meshtron.plan import probe as hardware_probe

    data = hardware_probe._read_cache(path)
    cached = data.get(key, {}).get("flops_per_s") if isinstance(data.get(key), dict) else None
    if isinstance(cached, float) and cached >= rate:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data[key] = {"flops_per_s": rate, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only home: the figure still serves this run
        pass
    return rate


def _cpu_key(dtype: torch.dtype) -> tuple[Any, str, str]:
    threads, name = torch.get_num_threads(), str(dtype).removeprefix("torch.")
    path, machine = _cache()
    source = f"this CPU's measured {name} matmul rate with {threads} thread(s)"
    return path, f"{machine}|{threads} threads|{name}|{METHOD}", source


def cpu_peak(dtype: torch.dtype, reprobe: bool | None = None) -> tuple[float, str]:
    """This CPU's best matmul rate with this process's threads: cached, or measured now (`reprobe`, or
    nothing cached) and kept if it is the best yet."""
    from meshtron.plan import probe as hardware_probe

    if reprobe is None:
        reprobe = os.environ.get("MESHTRON_REPROBE", "") not in ("", "0")
    path, key, source = _cpu_key(dtype)
    if not reprobe and key in _MEMO:
        return _MEMO[key], f"{source}, {_MEMO[key] / 1e9:,.1f} GFLOP/s (cached in {path})"
    entry = {} if reprobe else hardware_probe._read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), float):
        _MEMO[key] = entry["flops_per_s"]
        return _MEMO[key], f"{source}, {_MEMO[key] / 1e9:,.1f} GFLOP/s (cached in {path})"
    rate = _MEMO[key] = _keep_best(path, key, measure_matmul_rate(dtype))
    return rate, f"{source}, {rate / 1e9:,.1f} GFLOP/s (best measured, cached in {path})"


def cpu_peak_beaten(dtype: torch.dtype, reference: float) -> tuple[float, str]:
    """A step ran faster than `reference` allows: measure again now (this rank alone; no collective) and
    keep the best of the two and the cache. The MFU shown stays honest either way: above 100% it is a
    note, not a number."""
    path, key, source = _cpu_key(dtype)
    rate = _MEMO[key] = _keep_best(path, key, max(reference, measure_matmul_rate(dtype)))
    return (
        rate,
        f"{source}, {rate / 1e9:,.1f} GFLOP/s (measured again when a step beat the reference; {path})",
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
