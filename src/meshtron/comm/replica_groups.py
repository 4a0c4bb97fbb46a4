"""Replica groups that fail and heal on their own, through torchft (github.com/pytorch/torchft).

Under `fault_tolerance.enabled` every dp_replicate slice of the mesh is a job of its own (its own
launcher, process groups and restarts) and the slices meet only here. A lighthouse (torchft's) forms, each
step, a quorum of the replica groups that are alive; on every rank a torchft Manager talks to it through
its group's rank 0 and owns the one process group that crosses groups: this rank and the ranks in the
same position of the other live groups, rebuilt whenever the quorum changes.

  start_step()       the quorum; a group behind the others (restarted) fetches the state of the same rank
                     of a live group over HTTP and loads it (heal), before the step's forward
  sum_in_buckets_()  all-reduce (sum) over the live groups: the step's gradients, its loss
  commit()           every rank of the group votes; False when a peer failed during the step (the step is
                     then retried with the new quorum), and the same answer on every rank of the group

A failing peer never hangs a live group: gloo errors when a peer's socket closes, and every wait
(quorum, all-reduce, state transfer, vote) has the run's deadline, `run.comm_timeout_s`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm.group import CollectiveTimeout
from meshtron.config.schema import ConfigError

FATAL_KEY = "fatal"  # in the launcher's store: why the job cannot go on (and, under FATAL_KEY-group, whose)
CONSECUTIVE_FAILED_STEPS = 8  # votes in a row that may fail (peers dying) before the run stops


def start_lighthouse(replicas: int, heartbeat_ms: int = 1000) -> Any:
    """torchft's lighthouse on this host (any free port): quorums of at least one replica group, which a
    group leaves `heartbeat_ms` after its last heartbeat; `.address()` is what the groups dial."""
    os.environ.setdefault("RUST_LOG", "warn")  # not the lighthouse's line per quorum tick
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=60_000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=heartbeat_ms,
    )


def launcher_store() -> dist.TCPStore:
    """A store the launcher of the replica groups holds for the job's life, for what crosses groups outside
    torchft: the start (every group ready before the first quorum) and the newest committed step."""
    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)


def _store_at(address: str, timeout: datetime.timedelta) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)


class ReplicaGroups:
    """This rank's torchft Manager and the cross-group all-reduce.

    Args:
        index, count: this replica group's index among `count` (its dp_replicate coordinate).
        lighthouse: the lighthouse's address (http://host:port).
        world: this group's ranks (the process group of the group's own job).
        timeout_s: every wait's deadline.
        state_dict, load_state_dict: what a live group serves and a healing one loads (train/fault_tolerance.py).
        job_store: the launcher's store (`launcher_store`), or "" under a launcher of the user's own.
    """

    def __init__(
        self,
        index: int,
        count: int,
        lighthouse: str,
        world: Any,
        timeout_s: float,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        job_store: str = "",
    ):
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        # torchft logs each failed reduction's traceback and a warning per quorum; the training loop says
        # in one line what happened (train/fault_tolerance.py).
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

        self.index, self.count, self.lighthouse = index, count, lighthouse
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.world, self.rank, self.size = world, dist.get_rank(world), dist.get_world_size(world)
        # A store of this attempt's own for the Manager (its keys are not prefixed: a restarted group
        # must not read the address its previous attempt published), hosted by the group's rank 0.
        self._own_store, host, port = None, socket.gethostname(), 0
        if self.rank == 0:
            self._own_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._own_store.port
        where = [(host, port)]
        dist.broadcast_object_list(where, src=dist.get_global_rank(world, 0), group=world)
        cuda = torch.cuda.is_available() and dist.get_backend(world) == "nccl"
        pg = ProcessGroupNCCL(self.timeout) if cuda else ProcessGroupGloo(self.timeout)
        try:
            self.manager = self._manager(pg, where[0], state_dict, load_state_dict)
        except RuntimeError as err:  # (torchft says which address and deadline)
            raise ConfigError(
                [
                    f"replica group {index} could not reach the lighthouse at {lighthouse} (TORCHFT_LIGHTHOUSE) "
                    f"within run.comm_timeout_s={timeout_s:g}: is it running? {err}"
                ]
            ) from err
        self.job_store = _store_at(job_store, self.timeout) if job_store and self.rank == 0 else None

    def _manager(
        self,
        pg: Any,
        store: tuple[str, int],
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> Any:
        from torchft.manager import Manager

        return Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the forward: a rejoining group trains its first step
            timeout=self.timeout,
            quorum_timeout=self.timeout,
            connect_timeout=self.timeout,
            rank=self.rank,
            world_size=self.size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=self.lighthouse,
            replica_id=f"meshtron_{self.index:05d}",  # (torchft reads the index back from the trailing digits)
            init_sync=False,  # every group starts from the same seeded (or loaded) weights
            max_retries=CONSECUTIVE_FAILED_STEPS,
        )

    def wait_for_every_group(self) -> None:
        """At the job's start (not after a restart): every group ready before the first quorum, so that
        the first step has them all. On the group's rank 0; raises naming the groups that never came."""
        if self.job_store is None:
            return
        self.job_store.set(f"ready/{self.index}", "1")
        keys = [f"ready/{i}" for i in range(self.count)]
        try:
            self.job_store.wait(keys, self.timeout)
        except Exception as err:
            missing = [i for i in range(self.count) if not self.job_store.check([f"ready/{i}"])]
            raise CollectiveTimeout(
                f"replica group {self.index} waited {self.timeout.total_seconds():.0f} s "
                f"(run.comm_timeout_s) for replica group(s) {missing} to start"
            ) from err

    def start_step(self, step: int) -> int:
        """The quorum for the next step; heals this group when it is behind. Returns the step the live
        groups are at (this group's own, unless it healed)."""
        try:
            self.manager.start_quorum()
        except Exception as err:
            raise CollectiveTimeout(
                f"replica group {self.index}: no quorum for step {step + 1} from the lighthouse at "
                f"{self.lighthouse} within {self.timeout.total_seconds():.0f} s (run.comm_timeout_s): {err}"
            ) from err
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """The step a resumed group starts at (the checkpoint's)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def live(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def first_live(self) -> bool:
        """Whether this group is the lowest-numbered live one (the one that writes the metrics)."""
        return self.manager.participating_rank() == 0

    def sum_in_buckets_(self, tensors: list[torch.Tensor], bucket_elements: int) -> None:
        """Sum each tensor in place over the live groups, in flat buckets of about `bucket_elements` per
        dtype. After a peer's failure the values are garbage and `commit()` says False."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        buckets: list[list[torch.Tensor]] = []
        for same in by_dtype.values():
            buckets.append([])
            for t in same:
                if buckets[-1] and sum(x.numel() for x in buckets[-1]) + t.numel() > bucket_elements:
                    buckets.append([])
                buckets[-1].append(t)
        flats = [torch.cat([t.reshape(-1) for t in bucket]) for bucket in buckets if bucket]
        works = [self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM) for flat in flats]
        for work in works:
            work.wait()
        for flat, bucket in zip(flats, [b for b in buckets if b], strict=True):
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                t.copy_(part.view_as(t))

    def max_(self, t: torch.Tensor) -> None:
        """The elementwise max of `t` over the live groups, in place."""
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.MAX).wait()

    def errored(self) -> bool:
        """Whether a reduction of this step failed (a peer died)."""
        return self.manager.errored() is not None

    def commit(self) -> bool:
        """The group's vote that this step completed on every live group it reduced with."""
        return self.manager.should_commit()

    def record_step(self, step: int) -> None:
        """Tell the launcher the newest committed step (what a group that restarts alone must find)."""
        if self.job_store is not None:
            self.job_store.set("step", str(step))

    def job_step(self) -> int:
        """Collective over the group: the newest step any group committed, as the launcher's store holds
        it (-1: unknown)."""
        known = [-1]
        if self.job_store is not None and self.job_store.check(["step"]):
            known = [int(self.job_store.get("step"))]
        dist.broadcast_object_list(known, src=dist.get_global_rank(self.world, 0), group=self.world)
        return known[0]

    def report_fatal(self, message: str) -> None:
        """Tell the launcher the job cannot go on, and why (it stops every group and prints `message`)."""
        if self.job_store is not None:
            self.job_store.set(f"{FATAL_KEY}-group", str(self.index))
            self.job_store.set(FATAL_KEY, message)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def restart_attempt() -> int:
    """This group's restarts so far (torch's elastic agent counts them per group)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
