"""The collectives themselves, counted and waited on with a deadline: every byte meshtron moves between
ranks goes through `CountedCollectives` (collectives.py's docstring has the byte counts and the lanes).
Not differentiable: `Comm` (collectives.py) adds the autograd rules on top.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm import pairwise
from meshtron.comm.group import CollectiveTimeout, CommGroup
from meshtron.comm.kept_outputs import kept_or_issued
from meshtron.comm.pending import Pending, Works
from meshtron.comm.record import LANE, CommStats, Recording, Span, flight_name, recorder
from meshtron.comm.timing import TIMES

# Recent torch releases name the single-tensor collectives *_single and deprecate the older names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# A collective runs eagerly inside a compiled block, as one graph break: traced into, its accounting
# (a lock, host-side counters, a deadline) broke the graph line by line and dynamo compiled and
# recompiled each fragment (minutes on a CPU), with nothing in them to fuse. torch's lazy form of
# torch.compiler.disable, as models/moe.py's grouped_linear: the public one imports the compiler when
# this module loads (start-up time), this one at the first call.
eager = torch._disable_dynamo


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _splits_evenly(op: str, x: torch.Tensor, dim: int, group: CommGroup) -> None:
    if x.shape[dim] % group.size:
        raise ValueError(
            f"{op} on '{group.name}': dim {dim} of size {x.shape[dim]} is not divisible by the group size "
            f"{group.size}"
        )


class CountedCollectives:
    """Collectives on named groups, with accounting and a deadline on every wait (not differentiable:
    collectives.py's `Comm` adds the autograd rules)."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = CommStats()  # where collectives are counted: the innermost `recording`'s, if any
        # The pair lane: a twin per group for a thread running beside the main one (a DualPipeV pair's
        # forward during its backward), so each group's collectives keep one order per lane on every rank.
        self._twins: dict[str, Any] | None = None
        # Inside a `recording(spans=True)`: every wait as (op, group name, lane, start, end), perf_counter s.
        self.spans: list[Span] | None = None
        self.pairwise_all_to_all = False  # set where the backend has no all-to-all (`_exchange`)
        self.timed = True  # waits count in timing.TIMES (not a background checkpoint writer's)
        # Ranks per node (rank r on node r // ranks_per_node): the all-to-alls also count the bytes they
        # send off the node (CommStats.network); 0: not counted.
        self.ranks_per_node = 0

    @contextlib.contextmanager
    def recording(self, spans: bool = False) -> Iterator[Recording]:
        """Count the collectives issued inside the block apart: bytes and calls per group and collective
        (`Recording.stats`) and, with `spans`, every wait. An enclosing recording counts them too (a
        step's statistics include its pipeline's); what runs outside every recording of interest (set-up,
        evaluation, metrics) stays out of them."""
        outer_stats, outer_spans = self.stats, self.spans
        rec = Recording(CommStats(), [] if spans else None)
        self.stats, self.spans = rec.stats, rec.spans if spans else outer_spans
        try:
            yield rec
        finally:
            self.stats, self.spans = outer_stats, outer_spans
            outer_stats.merge(rec.stats)
            if spans and outer_spans is not None:
                outer_spans.extend(rec.spans or [])

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Collectives inside the block are counted in no recording: a check's own gathers issued in the
        middle of a step (parity's whole gradients) stay out of the step's statistics."""
        stats, spans = self.stats, self.spans
        self.stats, self.spans = CommStats(), None
        try:
            yield
        finally:
            self.stats, self.spans = stats, spans

    def add_pair_lane(self, twins: dict[str, Any]) -> None:
        """{process group name: its twin}: the groups collectives use on the pair lane (`pair_lane`);
        empty when no group a forward uses has more than one rank."""
        self._twins = dict(twins)

    def has_pair_lane(self) -> bool:
        return self._twins is not None

    @contextlib.contextmanager
    def pair_lane(self) -> Iterator[None]:
        """In this thread, issue every collective on its group's twin (`add_pair_lane`)."""
        before, LANE.pair = LANE.pair, True
        try:
            yield
        finally:
            LANE.pair = before

    def lane(self) -> str:
        return "pair" if LANE.pair else "main"

    def _pg(self, group: CommGroup) -> Any:
        """The process group to issue on: the group's own, or its twin on the pair lane."""
        if not LANE.pair:
            return group.process_group
        twin = (self._twins or {}).get(group.process_group.group_name)
        if twin is None:
            raise RuntimeError(
                f"group '{group.name}' has no twin on the pair lane: nothing may communicate on it while a "
                "pipeline pair runs its forward and backward at once"
            )
        return twin

    def group(self, name: str, ranks: list[int] | tuple[int, ...], process_group: Any) -> CommGroup:
        return CommGroup(name, tuple(ranks), process_group)

    # -- raw (non-differentiable) collectives; each records its volume and waits with a deadline --

    def wait(self, work: Any, op: str, group: CommGroup) -> None:
        flight = recorder()
        flight.begin_wait(op, group.name)
        start, mark = time.perf_counter(), TIMES.mark() if self.timed else None
        try:
            with TIMES.span(f"{op} on {group.name}"):
                completed = work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self._timeout_error(op, group, err) from err
        finally:
            flight.end_wait()
            if self.timed:
                TIMES.waited(group.name, mark, TIMES.mark())
            if self.spans is not None:
                self.spans.append((op, group.name, self.lane(), start, time.perf_counter()))
        if completed is False:
            raise self._timeout_error(op, group, None)

    def _timeout_error(self, op: str, group: CommGroup, cause: Exception | None) -> CollectiveTimeout:
        detail = f" ({cause})" if cause else ""
        flight = recorder()
        flight.begin_wait(op, group.name)
        report = flight.report(op, group.name, group.ranks)
        name = flight_name(group.name)
        return CollectiveTimeout(
            f"rank {dist.get_rank()}: {op} #{flight.issued[name]} on group '{name}' (ranks "
            f"{list(group.ranks)}) did not complete within {self.timeout.total_seconds():.0f}s{detail}; "
            "another rank of that group is probably stuck or crashed (raise run.comm_timeout_s if it is just "
            "slow)" + (f"\n{report}" if report else "")
        )

    @eager
    def all_reduce_(self, x: torch.Tensor, group: CommGroup, op: str = "sum") -> torch.Tensor:
        """In place; op is sum, avg or max (avg is a sum then a division where the backend lacks AVG)."""
        if group.size == 1:
            return x
        self.stats.record(group.name, "all_reduce", 2 * _nbytes(x) * (group.size - 1) / group.size)
        native_avg = op == "avg" and dist.get_backend(group.process_group) == "nccl"
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}[op]
        if native_avg:
            reduce_op = dist.ReduceOp.AVG
        self.wait(dist.all_reduce(x, op=reduce_op, group=self._pg(group), async_op=True), "all_reduce", group)
        if op == "avg" and not native_avg:
            x.div_(group.size)
        return x

    @eager
    def all_gather_tensor(self, x: torch.Tensor, group: CommGroup, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (all ranks' shapes equal). Reusable by a rerun
        (kept_outputs.py), as are the all-to-alls."""
        if group.size == 1:
            return x
        call = ("all_gather", group.name, tuple(x.shape), dim)
        return kept_or_issued(call, lambda: self._all_gather_tensor(x, group, dim))

    def _all_gather_tensor(self, x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((group.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        self.stats.record(group.name, "all_gather", _nbytes(out) * (group.size - 1) / group.size)
        self.wait(self._all_gather_work(out, moved, group), "all_gather", group)
        # Contiguous, so consumers (several projections read a gathered sequence) share one copy.
        return out.movedim(0, dim).contiguous()

    @eager
    def reduce_scatter_tensor(
        self, x: torch.Tensor, group: CommGroup, dim: int = 0, consume: bool = False
    ) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/n chunk along `dim` (size must divide evenly). With
        `consume`, x is the caller's scratch: gloo's path may reduce it in place instead of a copy.
        Reusable by a rerun (kept_outputs.py)."""
        if group.size == 1:
            return x
        _splits_evenly("reduce_scatter", x, dim, group)
        call = ("reduce_scatter", group.name, tuple(x.shape), dim)
        return kept_or_issued(call, lambda: self._reduce_scatter_tensor(x, group, dim, consume))

    def _reduce_scatter_tensor(
        self, x: torch.Tensor, group: CommGroup, dim: int, consume: bool
    ) -> torch.Tensor:
        moved = x.movedim(dim, 0).contiguous()
        if moved.data_ptr() == x.data_ptr() and not consume:
            moved = moved.clone()  # the async path reduces its input in place; never the caller's tensor
        out = torch.empty((moved.shape[0] // group.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        self.reduce_scatter_async(out, moved, group).wait()
        return out.movedim(0, dim)

    @eager
    def all_to_all_tensor(
        self, x: torch.Tensor, group: CommGroup, split_dim: int, concat_dim: int
    ) -> torch.Tensor:
        """Split `x` into n chunks along split_dim, send chunk j to rank j, concat what arrives on concat_dim."""
        if group.size == 1:
            return x
        call = ("all_to_all", group.name, tuple(x.shape), split_dim, concat_dim)
        return kept_or_issued(call, lambda: self._all_to_all_tensor(x, group, split_dim, concat_dim))

    def _all_to_all_tensor(
        self, x: torch.Tensor, group: CommGroup, split_dim: int, concat_dim: int
    ) -> torch.Tensor:
        _splits_evenly("all_to_all", x, split_dim, group)
        self.stats.record(group.name, "all_to_all", _nbytes(x) * (group.size - 1) / group.size)
        self._count_network(group, [_nbytes(x) / group.size] * group.size)
        inputs = [c.contiguous() for c in x.chunk(group.size, dim=split_dim)]
        outputs = [torch.empty_like(c) for c in inputs]
        self._exchange(outputs, inputs, group)
        return torch.cat(outputs, dim=concat_dim)

    def _exchange(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: CommGroup) -> None:
        """inputs[j] to rank j, outputs[i] from rank i: torch's all_to_all, or where the backend lacks it
        (gloo in torch 2.11) every pair's send and receive, posted together."""
        pg, me = self._pg(group), group.rank
        if not self.pairwise_all_to_all:
            try:
                return self.wait(
                    dist.all_to_all(outputs, inputs, group=pg, async_op=True), "all_to_all", group
                )
            except RuntimeError as err:  # (raised alike on every rank: the backend is the same)
                if "does not support alltoall" not in str(err):
                    raise
                self.pairwise_all_to_all = True
        self.wait(pairwise.exchange(outputs, inputs, pg, group.ranks, me), "all_to_all", group)

    def _count_network(self, group: CommGroup, to_each: list[float]) -> None:
        """Book the bytes `to_each[j]` sent to members j on another node than this rank's."""
        if self.ranks_per_node:
            here = group.ranks[group.rank] // self.ranks_per_node
            away = sum(
                b for r, b in zip(group.ranks, to_each, strict=True) if r // self.ranks_per_node != here
            )
            self.stats.record_network(group.name, away)

    @eager
    def all_to_all_single(
        self, x: torch.Tensor, group: CommGroup, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        """Variable-size exchange along dim 0 (token dispatch): rank j gets input_splits[j] rows."""
        if group.size == 1:
            return x
        call = ("all_to_all_v", group.name, tuple(x.shape), tuple(output_splits), tuple(input_splits))
        return kept_or_issued(call, lambda: self._all_to_all_single(x, group, output_splits, input_splits))

    def _all_to_all_single(
        self, x: torch.Tensor, group: CommGroup, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        row = _nbytes(x[:1]) if x.shape[0] else 0
        sent = (x.shape[0] - input_splits[group.rank]) * row
        self.stats.record(group.name, "all_to_all", sent)
        self._count_network(group, [rows * row for rows in input_splits])
        if not self.pairwise_all_to_all:
            try:
                work = dist.all_to_all_single(
                    out, x.contiguous(), output_splits, input_splits, group=self._pg(group), async_op=True
                )
                self.wait(work, "all_to_all", group)
                return out
            except RuntimeError as err:  # as in `_exchange`
                if "does not support alltoall" not in str(err):
                    raise
                self.pairwise_all_to_all = True
        self._exchange(list(out.split(output_splits)), list(x.contiguous().split(input_splits)), group)
        return out

    @eager
    def broadcast_(self, x: torch.Tensor, group: CommGroup, src: int) -> torch.Tensor:
        """In place from the group's local rank `src`."""
        return self._rooted("broadcast", x, group, src)

    @eager
    def reduce_(self, x: torch.Tensor, group: CommGroup, dst: int) -> torch.Tensor:
        """Sum into the group's local rank `dst`, in place (other ranks' x is left undefined)."""
        return self._rooted("reduce", x, group, dst)

    def _rooted(self, op: str, x: torch.Tensor, group: CommGroup, root: int) -> torch.Tensor:
        """A collective with a root (the group's local rank `root`): broadcast from it, or reduce to it."""
        if group.size == 1:
            return x
        self.stats.record(group.name, op, _nbytes(x) * (group.size - 1) / group.size)
        pg, rank = self._pg(group), group.ranks[root]
        if op == "broadcast":
            work = dist.broadcast(x, src=rank, group=pg, async_op=True)
        else:
            work = dist.reduce(x, dst=rank, group=pg, async_op=True)
        self.wait(work, op, group)
        return x

    def isend(self, x: torch.Tensor, group: CommGroup, dst: int) -> Pending:
        """Non-blocking send; keep `x` alive until the returned handle has been waited on."""
        self.stats.record(group.name, "send", _nbytes(x))
        return Pending(self.wait, dist.isend(x, dst=group.ranks[dst], group=self._pg(group)), "send", group)

    def irecv(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        group: CommGroup,
        src: int,
    ) -> tuple[Pending, torch.Tensor]:
        """Post a receive; the returned tensor holds the message after the handle's `wait()`."""
        out = torch.empty(shape, dtype=dtype, device=device)
        self.stats.record(group.name, "recv", _nbytes(out))
        return Pending(
            self.wait, dist.irecv(out, src=group.ranks[src], group=self._pg(group)), "recv", group
        ), out

    def sendrecv(self, x: torch.Tensor, group: CommGroup, dst: int, src: int) -> tuple[Pending, torch.Tensor]:
        """Send `x` to `dst` and receive a tensor of its shape from `src`, posted together (NCCL needs a
        send and a receive between the same two ranks in one batch, or both ranks block in the send).
        Keep `x` alive until the handle has been waited on; the returned tensor is valid after it."""
        out = torch.empty_like(x)
        self.stats.record(group.name, "send", _nbytes(x))
        self.stats.record(group.name, "recv", _nbytes(out))
        ops = [
            dist.P2POp(dist.isend, x, group.ranks[dst], self._pg(group)),
            dist.P2POp(dist.irecv, out, group.ranks[src], self._pg(group)),
        ]
        return Pending(self.wait, Works(dist.batch_isend_irecv(ops)), "sendrecv", group), out

    def all_gather_object(self, obj: Any, group: CommGroup) -> list[Any]:
        """Every rank's picklable `obj`, in group order: for reports, not counted in the statistics."""
        if group.size == 1:
            return [obj]
        out: list[Any] = [None] * group.size
        dist.all_gather_object(out, obj, group=self._pg(group))
        return out

    def barrier(self, group: CommGroup) -> None:
        if group.size > 1:
            self.wait(dist.barrier(group=self._pg(group), async_op=True), "barrier", group)

    # -- asynchronous collectives on preallocated buffers, for overlapping communication with compute --

    def all_reduce_async(self, x: torch.Tensor, group: CommGroup) -> Pending:
        """Sum `x` in place over the group; the result is valid after `.wait()`."""
        if group.size == 1:
            return Pending(self.wait, None, "all_reduce", group)
        self.stats.record(group.name, "all_reduce", 2 * _nbytes(x) * (group.size - 1) / group.size)
        work = dist.all_reduce(x, group=self._pg(group), async_op=True)
        return Pending(self.wait, work, "all_reduce", group)

    def all_to_all_single_async(
        self, x: torch.Tensor, group: CommGroup, output_splits: list[int], input_splits: list[int]
    ) -> tuple[torch.Tensor, Pending]:
        """`all_to_all_single` in flight: (the output buffer, valid after `.wait()`, and its handle)."""
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        if group.size == 1:
            out.copy_(x)
            return out, Pending(self.wait, None, "all_to_all", group)
        row = _nbytes(x[:1]) if x.shape[0] else 0
        self.stats.record(group.name, "all_to_all", (x.shape[0] - input_splits[group.rank]) * row)
        self._count_network(group, [rows * row for rows in input_splits])
        x = x.contiguous()
        if not self.pairwise_all_to_all:
            try:
                work = dist.all_to_all_single(
                    out, x, output_splits, input_splits, group=self._pg(group), async_op=True
                )
                return out, Pending(self.wait, work, "all_to_all", group)
            except RuntimeError as err:  # as in `_exchange`
                if "does not support alltoall" not in str(err):
                    raise
                self.pairwise_all_to_all = True
        outputs, inputs = list(out.split(output_splits)), list(x.split(input_splits))
        work = pairwise.exchange(outputs, inputs, self._pg(group), group.ranks, group.rank)
        return out, Pending(self.wait, work, "all_to_all", group)

    def reduce_scatter_is_all_reduce(self, group: CommGroup) -> bool:
        """Whether the backend runs a reduce-scatter as an all-reduce of the whole input (gloo has none
        of its own): a caller that keeps the whole sum anyway can then all-reduce in place instead."""
        return group.size > 1 and self._is_gloo(group)

    @staticmethod
    def _is_gloo(group: CommGroup) -> bool:
        return dist.get_backend(group.process_group) == "gloo"

    def reduce_scatter_kept_whole_async(
        self, x: torch.Tensor, group: CommGroup, counted_numel: int
    ) -> Pending:
        """A reduce-scatter whose caller keeps the whole sum anyway, on a backend that runs one as an
        all-reduce (`reduce_scatter_is_all_reduce`): `x` is all-reduced in place. Counted as the
        reduce-scatter it stands for, of `counted_numel` elements (the padded rank-major buffer it
        would have packed), as every gloo reduce-scatter is counted (the module docstring)."""
        if not self.reduce_scatter_is_all_reduce(group):
            raise ValueError(
                "reduce_scatter_kept_whole_async needs a backend whose reduce-scatter all-reduces"
            )
        self.stats.record(
            group.name, "reduce_scatter", counted_numel * x.element_size() * (group.size - 1) / group.size
        )
        work = dist.all_reduce(x, group=self._pg(group), async_op=True)
        return Pending(self.wait, work, "reduce_scatter", group)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, group: CommGroup) -> Pending:
        """out (numel n) = this rank's n-element chunk of the sum over ranks of inp (numel n * size).
        `inp` is scratch: its contents are undefined afterwards."""
        if group.size == 1:
            out.copy_(inp.view_as(out))
            return Pending(self.wait, None, "reduce_scatter", group)
        self.stats.record(group.name, "reduce_scatter", _nbytes(inp) * (group.size - 1) / group.size)
        if dist.get_backend(group.process_group) == "gloo":
            # Gloo's reduce-scatter clones its whole input and all-reduces the clone; all-reducing our
            # scratch buffer in place moves the same bytes without the clone.
            work = dist.all_reduce(inp, group=self._pg(group), async_op=True)
            own_chunk = inp.view(group.size, -1)[group.rank].view_as(out)
            return Pending(self.wait, work, "reduce_scatter", group, on_done=lambda: out.copy_(own_chunk))
        work = _reduce_scatter_single(out, inp, group=self._pg(group), async_op=True)
        return Pending(self.wait, work, "reduce_scatter", group)

    def all_gather_async(
        self, out: torch.Tensor, inp: torch.Tensor, group: CommGroup, booked: bool = False
    ) -> Pending:
        """out (numel n * size) = every rank's inp (numel n), in rank order. `booked`: its bytes were
        counted earlier by `book_all_gather` (in the step whose update it carries)."""
        if group.size == 1:
            out.view_as(inp).copy_(inp)
            return Pending(self.wait, None, "all_gather", group)
        if booked:
            recorder().note(group.name, "all_gather", _nbytes(out) * (group.size - 1) / group.size)
        else:
            self.book_all_gather(_nbytes(out), group)
        return Pending(self.wait, self._all_gather_work(out, inp, group), "all_gather", group)

    def _all_gather_work(self, out: torch.Tensor, inp: torch.Tensor, group: CommGroup) -> Any:
        if self._is_gloo(group):  # faster there as every pair's messages (pairwise.py)
            return pairwise.all_gather(out, inp, self._pg(group), group.ranks, group.rank)
        return _all_gather_single(out, inp, group=self._pg(group), async_op=True)

    def book_all_gather(self, out_nbytes: int, group: CommGroup) -> None:
        """Count the bytes and the call of an all-gather (into `out_nbytes` bytes) to be issued later."""
        if group.size > 1:
            self.stats.record(group.name, "all_gather", out_nbytes * (group.size - 1) / group.size, False)

    def book(self, op: str, full_nbytes: int, group: CommGroup) -> None:
        """Count an all-gather or reduce-scatter of `full_nbytes` (unsharded) inside a compiled graph,
        as bytes and no call (the compiler may have merged it with others)."""
        if group.size > 1:
            self.stats.record(group.name, op, full_nbytes * (group.size - 1) / group.size, False, calls=0)
