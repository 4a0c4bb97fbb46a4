"""Issue 45.11: a one-rank CPU run's thread count from the cores the load leaves free, and an MFU
reference that a busy probe of more threads never lowers below a figure of fewer."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.probe import peak
from meshtron.train import threads


@pytest.mark.parametrize(
    ("cores", "load", "default", "expected"),
    [
        (2, 0.3, 2, 2),  # idle: torch's default
        (2, 0.6, 2, 1),  # another process most of the time on one core
        (2, 17.8, 2, 1),  # far more runnable processes than cores: still one
        (16, 3.2, 16, 13),
        (16, 0.0, 8, 8),  # never above torch's default (physical cores)
    ],
)
def test_threads_are_the_cores_the_load_leaves_free(cores, load, default, expected):
    assert threads.free_core_threads(cores, load, default) == expected


def test_one_rank_threads_follow_the_load_unless_omp_num_threads_is_set(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(threads, "_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.6, 8.0, 4.0))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose_one_rank_threads("auto") is None and chosen == []  # the user's choice stands
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose_one_rank_threads("cuda") is None and chosen == []  # a GPU run: as torch has it
    line = threads.choose_one_rank_threads("cpu")
    assert chosen == [1]
    assert line == (
        "meshtron: 1 torch thread (the load average 9.6 leaves 0 of 2 cores free; OMP_NUM_THREADS=N sets it)"
    )


def test_a_busy_probe_of_more_threads_never_lowers_the_reference_below_fewer_threads(tmp_path, monkeypatch):
    """Issue 45.11's case: one thread measured 82.6 GFLOP/s; a two-thread probe on a loaded machine
    measured 31.9. A two-thread run's reference is 82.6, and 31.9 is not written; a later quiet
    two-thread figure above 82.6 is."""
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    monkeypatch.delenv("MESHTRON_REPROBE", raising=False)
    monkeypatch.setattr(peak, "_MEMO", {})
    monkeypatch.setattr(peak, "_MEASURED_AGAIN", set())
    rates = iter([82.6e9, 31.9e9, 150e9])
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda dtype: next(rates))
    current = {"threads": 1}
    monkeypatch.setattr(torch, "get_num_threads", lambda: current["threads"])
    assert peak.cpu_peak(torch.float32)[0] == 82.6e9  # one thread: measured and cached
    current["threads"] = 2
    peak._MEMO.clear()  # a new process of two threads: the one-thread figure serves, nothing measured
    rate, source = peak.cpu_peak(torch.float32)
    assert rate == 82.6e9 and "with 2 threads, 82.6 GFLOP/s (measured with 1" in source
    rate, _ = peak.cpu_peak(torch.float32, reprobe=True)  # a loaded two-thread probe: 31.9
    assert rate == 82.6e9
    cache = json.loads((tmp_path / peak.CACHE_FILE).read_text())
    assert [e["threads"] for e in cache.values()] == [1] and "load_average" in next(iter(cache.values()))
    rate, _ = peak.cpu_peak_beaten(torch.float32, rate)  # quiet now: two threads reach 150
    assert rate == 150e9
    peak._MEMO.clear()
    assert peak.cpu_peak(torch.float32)[0] == 150e9  # the two-thread figure, for later runs
    current["threads"] = 1
    peak._MEMO.clear()
    assert peak.cpu_peak(torch.float32)[0] == 82.6e9  # a one-thread run keeps its own
