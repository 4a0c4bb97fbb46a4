"""A pool of long-lived gloo worker processes that run functions on every rank.

Tests and benchmarks start the pool once and send it many functions, instead of paying
process start-up and `import torch` per test. A function is sent by reference (module + name), so it
must be importable at module level; every rank runs it with the same arguments and the pool returns
each rank's result. An exception on any rank is re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any


class WorkerError(RuntimeError):
    """A function failed (or hung) on one or more ranks of the pool."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    from meshtron.comm.record import recorder

    recorder().attach(store, rank)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - any failure must reach the parent, not kill the pool
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: freeing every tensor and gloo context of hundreds of
    # jobs one by one takes seconds per rank, and nothing is left to flush (the parent has every result).
    results.close()
    results.join_thread()
    os._exit(0)


class WorkerPool:
    """`world_size` gloo ranks on this machine, each with a process group over all of them."""

    def __init__(self, world_size: int, timeout_s: float = 300.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by each child's OpenMP runtime at start-up
        try:
            self._procs = [
                ctx.Process(
                    target=_worker_main,
                    args=(r, world_size, port, self._tasks[r], self._results),
                    daemon=True,
                )
                for r in range(world_size)
            ]
            for p in self._procs:
                p.start()
        finally:
            if previous is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = previous
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; results in rank order."""
        if self.broken:
            raise WorkerError("the worker pool was shut down after an earlier hang or crash")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                raise WorkerError(
                    f"{fn.__qualname__}: ranks {missing} gave no result within {self.timeout_s}s; "
                    "the pool was shut down"
                ) from None
            outcomes[rank] = (ok, value)
            if not ok:
                # The other ranks may now wait forever on a collective with the failed one.
                self.close()
                raise WorkerError(f"{fn.__qualname__} failed on rank {rank}:\n{value}")
        return [outcomes[r][1] for r in range(self.world_size)]

    @contextlib.contextmanager
    def waiting_up_to(self, seconds: float) -> Iterator[None]:
        """Calls inside wait up to `seconds` for each rank's result (compiling on oversubscribed cores
        takes minutes), then the pool's own timeout again."""
        before, self.timeout_s = self.timeout_s, seconds
        try:
            yield
        finally:
            self.timeout_s = before

    def threads(self) -> int:
        """The most threads any rank runs, 0 where /proc cannot tell. Each gloo process group a rank holds
        runs threads, one of which wakes to poll even while idle, until the group is destroyed: a pool
        holding many meshes spends cores on them while it waits."""
        counts = [0]
        for p in self._procs:
            with contextlib.suppress(OSError):
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
        return max(counts)

    def close(self) -> None:
        close_pools([self])


def close_pools(pools: list[WorkerPool]) -> None:
    """Stop every rank of every pool: all are told at once, so that they wind down together."""
    stopping = [pool for pool in pools if not pool.broken]
    for pool in stopping:
        pool.broken = True
        for q in pool._tasks:
            q.put(None)
    for p in (p for pool in stopping for p in pool._procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
