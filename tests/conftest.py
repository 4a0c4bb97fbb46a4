"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test."""

from __future__ import annotations

import os

import pytest

from meshtron.testing.workers import WorkerPool, close_pools

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every gloo process group a rank has made keeps threads that wake to poll, even after it is destroyed
# (a ParallelMesh makes about 24 per rank): 4 idle ranks with 250 threads each burn half a core here,
# and a suite that kept every pool as it grew spent most of the machine on idle pools. So the pool asked
# for is restarted (about 6 s) past MAX_POOL_THREADS per rank, and while all pools together hold more
# than MAX_TOTAL_THREADS, the other pools are closed, the largest first (their next use restarts them).
MAX_POOL_THREADS = 150
MAX_TOTAL_THREADS = 1000


def _held(pool: WorkerPool) -> int:
    return 0 if pool.broken else pool.threads() * pool.world_size


@pytest.fixture(scope="session")
def workers():
    """workers(n) -> a WorkerPool of n ranks, started on first use and kept for the session."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        others = sorted((p for size, p in pools.items() if size != world_size), key=_held, reverse=True)
        for idle in others:
            if sum(_held(p) for p in pools.values()) <= MAX_TOTAL_THREADS:
                break
            idle.close()
        pool = pools.get(world_size)
        if pool is not None and not pool.broken and pool.threads() > MAX_POOL_THREADS:
            pool.close()  # a fresh pool: its ranks no longer poll the threads of old process groups
        if pool is None or pool.broken:
            pool = pools[world_size] = WorkerPool(world_size, timeout_s=180)
        return pool

    yield get
    close_pools(list(pools.values()))
