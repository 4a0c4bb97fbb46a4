"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test."""

from __future__ import annotations

import os

import pytest

from meshtron.testing.workers import WorkerPool, close_pools

os.environ.setdefault("OMP_NUM_THREADS", "1")
MAX_POOL_THREADS = 300  # WorkerPool.threads(): past this, a pool is restarted (a few seconds)


@pytest.fixture(scope="session")
def workers():
    """workers(n) -> a WorkerPool of n ranks, started on first use and kept for the session."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        pool = pools.get(world_size)
        if pool is not None and not pool.broken and pool.threads() > MAX_POOL_THREADS:
            pool.close()  # a fresh pool: its ranks no longer poll the threads of old process groups
        if pool is None or pool.broken:
            pool = pools[world_size] = WorkerPool(world_size, timeout_s=180)
        return pool

    yield get
    close_pools(list(pools.values()))
