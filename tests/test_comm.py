"""Every comm wrapper's forward and backward against the same math done in one process."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CollectiveTimeout, CommGroup


def _world_group(comm: Comm) -> CommGroup:
    return comm.group("world", list(range(dist.get_world_size())), dist.group.WORLD)


def _inputs(world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Every rank's input, reproducible everywhere so each rank can compute the reference itself."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _upstream(world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def check_collective(name: str) -> dict[str, float]:
    """Run collective `name` with autograd on this rank and compare with a one-process reference where the
    loss is sum over ranks of <output_r, upstream_r>."""
    comm = Comm(timeout_s=60)
    group = _world_group(comm)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = _inputs(world, (2 * world, 3))
    shapes = {"all_gather": (2 * world * world, 3), "reduce_scatter": (2, 3), "split_to_group": (2, 3)}
    ups = _upstream(world, shapes.get(name, (2 * world, 3)))
    # split_to_group's input is replicated: every rank holds the same logical tensor.
    x = xs[0 if name == "split_to_group" else rank].clone().requires_grad_(True)

    refs = [t.clone().requires_grad_(True) for t in xs]
    if name in ("all_reduce", "reduce_from_group"):  # the same sum; they differ in backward
        out = getattr(comm, name)(x, group)
        total = sum(refs)
        ref_outs = [total for _ in range(world)]
    elif name == "all_gather":
        out = comm.all_gather(x, group, dim=0)
        cat = torch.cat(refs, 0)
        ref_outs = [cat for _ in range(world)]
    elif name == "all_gather_dim1":
        out = comm.all_gather(x, group, dim=1)
        cat = torch.cat(refs, 1)
        ref_outs = [cat for _ in range(world)]
        ups = _upstream(world, (2 * world, 3 * world))
    elif name == "reduce_scatter":
        out = comm.reduce_scatter(x, group, dim=0)
        total = sum(refs)
        ref_outs = list(total.chunk(world, 0))
    elif name == "all_to_all":
        out = comm.all_to_all(x, group, split_dim=0, concat_dim=1)
        ref_outs = [
            torch.cat([refs[src].chunk(world, 0)[dst] for src in range(world)], 1) for dst in range(world)
        ]
        ups = _upstream(world, (2, 3 * world))
    elif name == "broadcast":
        out = comm.broadcast(x, group, src=1)
        ref_outs = [refs[1] for _ in range(world)]
    elif name == "split_to_group":
        out = comm.split_to_group(x, group, dim=0)
        shared = refs[0]
        ref_outs = list(shared.chunk(world, 0))
    else:
        raise ValueError(name)

    (out * ups[rank]).sum().backward()
    sum((o * u).sum() for o, u in zip(ref_outs, ups, strict=True)).backward()
    if name == "split_to_group":
        # Replicated input: every rank holds the same logical tensor, whose gradient is the total.
        ref_grad = refs[0].grad
    elif name == "reduce_from_group":
        # Replicated output: only the copy's own upstream flows back, unchanged.
        ref_grad = ups[rank]
    else:
        ref_grad = refs[rank].grad if refs[rank].grad is not None else torch.zeros_like(x)
    return {
        "fwd": float((out.detach() - ref_outs[rank].detach()).abs().max()),
        "bwd": float((x.grad - ref_grad).abs().max()),
        "bytes": comm.stats.total_bytes(),
        "calls": comm.stats.total_calls(),
    }


def check_copy_to_group_replicated() -> float:
    """copy_to_group with the same input on all ranks: the grad is the sum of all ranks' upstreams."""
    comm = Comm(timeout_s=60)
    group = _world_group(comm)
    x = _inputs(1, (4,))[0].clone().requires_grad_(True)
    ups = _upstream(dist.get_world_size(), (4,))
    (comm.copy_to_group(x, group) * ups[dist.get_rank()]).sum().backward()
    return float((x.grad - sum(ups)).abs().max())


COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_dim1",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "split_to_group",
    "reduce_from_group",
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_forward_backward(workers, world, name):
    results = workers(world).run(check_collective, name)
    for r in results:
        assert r["fwd"] < 1e-12, (name, r)
        assert r["bwd"] < 1e-12, (name, r)


def test_copy_to_group(workers):
    for err in workers(2).run(check_copy_to_group_replicated):
        assert err < 1e-12


def byte_accounting() -> dict:
    comm = Comm(timeout_s=60)
    group = _world_group(comm)
    n = dist.get_world_size()
    x = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    comm.all_reduce_(x, group)
    comm.all_gather_tensor(torch.zeros(250), group)  # gathers to 1000 floats
    comm.reduce_scatter_tensor(torch.zeros(1000), group)
    comm.all_to_all_tensor(torch.zeros(1000), group, 0, 0)
    single = comm.group("solo", [dist.get_rank()], None)
    comm.all_reduce_(x, single)  # a size-1 group moves nothing
    return {
        "n": n,
        "by_op": {
            op: comm.stats.total_bytes(op=op)
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        },
        "calls": comm.stats.total_calls(),
        "groups": comm.stats.by_group(),
    }


def nested_recordings() -> dict:
    """An all-reduce in an outer recording, an all-gather in an inner one that keeps spans, another
    all-reduce after both."""
    comm = Comm(timeout_s=60)
    group = _world_group(comm)
    with comm.recording() as outer:
        comm.all_reduce_(torch.zeros(100), group)
        with comm.recording(spans=True) as inner:
            comm.all_gather_tensor(torch.zeros(100), group)
        inner_stats = dict(comm.stats.bytes)  # back to the outer's, which now holds both
    comm.all_reduce_(torch.zeros(100), group)
    return {
        "outer": dict(outer.stats.bytes),
        "inner": dict(inner.stats.bytes),
        "outer_after_inner": inner_stats,
        "spans": [(op, name, lane) for op, name, lane, start, end in inner.spans if end >= start],
        "outer_spans": outer.spans,
        "base": dict(comm.stats.bytes),
    }


def test_recordings_count_their_block_and_nest(workers):
    for r in workers(2).run(nested_recordings):
        reduce, gather = ("world", "all_reduce"), ("world", "all_gather")
        # 100 floats all-reduced: 2 * 400 bytes * (n - 1) / n; gathered into 200: 800 * (n - 1) / n
        assert r["inner"] == {gather: 800 / 2}
        assert r["outer"] == r["outer_after_inner"] == {reduce: 2 * 400 / 2, gather: 800 / 2}
        assert r["spans"] == [("all_gather", "world", "main")] and r["outer_spans"] is None
        assert r["base"] == {reduce: 2 * 2 * 400 / 2, gather: 800 / 2}  # the comm's own, since it was made


def test_byte_accounting_matches_ring_volumes(workers):
    for r in workers(4).run(byte_accounting):
        n = r["n"]
        assert r["by_op"]["all_reduce"] == 2 * 4000 * (n - 1) / n
        assert r["by_op"]["all_gather"] == 4000 * (n - 1) / n
        assert r["by_op"]["reduce_scatter"] == 4000 * (n - 1) / n
        assert r["by_op"]["all_to_all"] == 4000 * (n - 1) / n
        assert r["calls"] == 4
        assert set(r["groups"]) == {"world"}


def stuck_collective() -> str:
    comm = Comm(timeout_s=2)
    group = _world_group(comm)
    if dist.get_rank() == 0:
        try:
            comm.all_reduce_(torch.ones(3), group)
        except CollectiveTimeout as err:
            message = str(err)
        else:
            message = "no timeout"
        time.sleep(3)  # let rank 1 join so the pending all-reduce completes and the pool stays healthy
        return message
    time.sleep(3)
    comm.all_reduce_(torch.ones(3), group)
    return ""


def ring_exchange() -> dict:
    """Every rank sends its tensor to the next and receives the previous rank's, in one batch."""
    comm = Comm(timeout_s=60)
    group = _world_group(comm)
    n, r = group.size, group.rank
    mine = torch.full((2, 3), float(r), dtype=torch.float64)
    pending, received = comm.sendrecv(mine, group, (r + 1) % n, (r - 1) % n)
    pending.wait()
    return {
        "received": float(received[0, 0]),
        "sent": comm.stats.total_bytes(op="send"),
        "recv": comm.stats.total_bytes(op="recv"),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_sendrecv_ring_exchange(workers, world):
    """With two ranks both messages go between the same pair, the case NCCL needs batched."""
    for rank, got in enumerate(workers(world).run(ring_exchange)):
        assert got == {"received": float((rank - 1) % world), "sent": 48, "recv": 48}


def test_timeout_names_rank_collective_and_group(workers):
    message = workers(2).run(stuck_collective)[0]
    assert "rank 0" in message
    assert "all_reduce" in message
    assert "'world'" in message and "[0, 1]" in message


def pairwise_all_to_all_matches() -> bool:
    """Every pair's send and receive (what a backend without all-to-all gets: gloo in torch 2.11)
    gives the all-to-all's result, even and uneven (with an empty split)."""
    comm = Comm()
    group = _world_group(comm)
    n, r = group.size, group.rank
    x = torch.arange(n * 6 * 3, dtype=torch.float32).view(n * 6, 3) + 1000 * r
    splits = [(r + j) % 3 for j in range(n)]  # rows rank r sends to rank j (0 for some pairs)
    received = [(i + r) % 3 for i in range(n)]  # rows rank i sends here
    rows = x[: sum(splits)]
    results = []
    for pairwise in (False, True):
        comm.pairwise_all_to_all = pairwise
        results.append(
            (comm.all_to_all_tensor(x, group, 0, 1), comm.all_to_all_single(rows, group, received, splits))
        )
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_pairwise_all_to_all_equals_the_collective(workers, world):
    assert all(workers(world).run(pairwise_all_to_all_matches))


def pairwise_all_gather_matches() -> bool:
    """On gloo the all-gathers go pair by pair (comm/pairwise.py): two in flight at once, with a ring's
    send and receive (tag 0) on the same group between them, still give torch's all-gather."""
    comm = Comm()
    group = _world_group(comm)
    n, r = group.size, group.rank
    parts = [torch.arange(5, dtype=torch.float32) + 100 * r + 10 * k for k in range(2)]
    outs = [torch.empty(5 * n) for _ in parts]
    first = comm.all_gather_async(outs[0], parts[0], group)
    ring, received = comm.sendrecv(torch.full((3,), float(r)), group, (r + 1) % n, (r - 1) % n)
    second = comm.all_gather_async(outs[1], parts[1], group)
    for pending in (second, ring, first):
        pending.wait()
    expected = [torch.empty(5 * n) for _ in parts]
    for want, part in zip(expected, parts, strict=True):
        dist.all_gather_into_tensor(want, part)
    tensor = comm.all_gather_tensor(parts[0].view(5, 1), group, dim=1)
    return (
        all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
        and torch.equal(received, torch.full((3,), float((r - 1) % n)))
        and torch.equal(tensor, expected[0].view(n, 5).T)
    )


@pytest.mark.parametrize("world", [2, 3])
def test_pairwise_all_gather_equals_the_collective(workers, world):
    assert all(workers(world).run(pairwise_all_gather_matches))
