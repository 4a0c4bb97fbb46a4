"""What every rank of the hardware probe measures, all ranks at once (hardware.py says how the
figures become the planner's cluster, and why each is measured this way).

Each function runs on every rank of a gloo world of `WorkerPool` processes; collectives go through
meshtron.comm.collectives. Compute is timed in wall-clock windows started by a barrier, collectives in fixed counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from meshtron.plan.flops import keys_per_query


@dataclass(frozen=True, kw_only=True)
class ProbeSizes:
    """What the probe runs: the demo model's shapes by default (configs/demo.toml, micro-batch 4)."""

    rows: int = 512  # tokens of a micro-batch
    dim: int = 256
    ffn: int = 688
    vocab: int = 4096
    heads: int = 8
    kv_heads: int = 4
    seq: int = 128
    layers: int = 4
    copy_mib: int = 64  # large enough to leave the caches
    comm_mib: int = 16  # the large collective: DDP's demo gradients are one 20 MB bucket
    p2p_kib: int = 512  # the large pair exchange: the demo's ring hop and pipeline message
    window_s: float = 0.25  # per compute measurement
    repeats: int = 3  # windows (compute) or rounds (collectives); the best is kept

    @property
    def tag(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())


DEMO = ProbeSizes()
# For tests: the same method on small shapes, a second or two of measuring.
_SMALL_SHAPES = dict(rows=128, dim=64, ffn=128, vocab=256, heads=4, kv_heads=2, seq=32, layers=1)
QUICK = ProbeSizes(**_SMALL_SHAPES, copy_mib=4, comm_mib=2, p2p_kib=64, window_s=0.05, repeats=2)


# -- on every rank --


Work = list[tuple[Callable[[], object], float]]  # calls and the work (FLOPs, bytes) each does


def _timed_window(comm: Any, world: Any, work: Work, sizes: ProbeSizes) -> float:
    """Work per second while every rank runs `work`'s calls in turn for the same wall-clock window
    (calls are short next to it, so no rank runs much past it alone); the best window."""
    for fn, _ in work:  # warm: first-call allocation and BLAS thread start-up
        fn()
    best = 0.0
    for _ in range(sizes.repeats):
        comm.barrier(world)
        done, calls, start = 0.0, 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < sizes.window_s or calls == 0:
            fn, amount = work[calls % len(work)]
            fn()
            done, calls = done + amount, calls + 1
        best = max(best, done / elapsed)
    return best


def _linear_shapes(sizes: ProbeSizes) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections: q, k, v, o, SwiGLU gate, up, down."""
    hd = sizes.dim // sizes.heads
    q, kv = sizes.heads * hd, sizes.kv_heads * hd
    d, f = sizes.dim, sizes.ffn
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def _matmul_suite(sizes: ProbeSizes) -> Work:
    """The matmuls of `layers` layers and the head, forward and both backward products as autograd
    runs them for F.linear (x·Wᵀ, g·W, gᵀ·x), each layer on its own tensors (as in a step, where
    they do not stay in cache), with their FLOPs."""
    import torch

    work: Work = []
    shapes = _linear_shapes(sizes) * sizes.layers + [(sizes.dim, sizes.vocab)]
    for k, n in shapes:
        x, w, g = torch.randn(sizes.rows, k), torch.randn(n, k), torch.randn(sizes.rows, n)
        flops = 2.0 * sizes.rows * k * n
        work += [
            (lambda x=x, w=w: torch.mm(x, w.t()), flops),
            (lambda g=g, w=w: torch.mm(g, w), flops),
            (lambda g=g, x=x: torch.mm(g.t(), x), flops),
        ]
    return work


def _attention_call(sizes: ProbeSizes) -> Work:
    """fp32 SDPA forward + backward as the model calls it (q, k, v and the output's gradient are
    [batch, seq, heads, head_dim] tensors seen transposed), with the FLOPs the planner counts for it."""
    import torch
    import torch.nn.functional as F

    batch, hd = max(1, sizes.rows // sizes.seq), sizes.dim // sizes.heads
    q = torch.randn(batch, sizes.seq, sizes.heads, hd, requires_grad=True)
    k = torch.randn(batch, sizes.seq, sizes.kv_heads, hd, requires_grad=True)
    v = torch.randn(batch, sizes.seq, sizes.kv_heads, hd, requires_grad=True)
    grad = torch.randn(batch, sizes.seq, sizes.heads, hd)

    def run() -> None:
        qkv = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=sizes.heads != sizes.kv_heads)
        out.backward(grad.transpose(1, 2))

    core = 4.0 * sizes.heads * hd * keys_per_query(sizes.seq) * batch * sizes.seq
    return [(run, 3 * core)]  # forward once, backward twice (plan/compute_time.py)


def _copy_call(sizes: ProbeSizes) -> Work:
    """A copy of a tensor too large for the caches, and the bytes it reads and writes."""
    import torch

    src = torch.ones(sizes.copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return [(lambda: dst.copy_(src), 2.0 * src.numel() * 4)]


def _optimizer_call(sizes: ProbeSizes) -> Work:
    """The trainer's per-parameter work after backward on the model's parameters: the gradient norm
    and clipping scale, foreach AdamW (weight decay on matrices), zeroing the gradients; as work, the
    32 bytes per element the planner counts for it (plan/estimate.py)."""
    import torch

    from meshtron.engines.engine import sum_of_squares

    shapes = [(n, k) for k, n in _linear_shapes(sizes)] + [(sizes.dim,)] * 2
    shapes = shapes * sizes.layers + [(sizes.vocab, sizes.dim)] * 2 + [(sizes.dim,)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    groups = [
        {"params": [p for p in params if p.ndim == d], "weight_decay": w} for d, w in ((2, 0.1), (1, 0.0))
    ]
    adamw = torch.optim.AdamW(groups, lr=1e-4, foreach=True)

    def run() -> None:
        norm = sum_of_squares(grads).sqrt().float()
        torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        adamw.step()
        torch._foreach_zero_(grads)

    return [(run, 32.0 * sum(p.numel() for p in params))]


def _collective_seconds(comm: Any, world: Any, fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds per call of a collective every rank runs `calls` times (fixed counts: every rank must
    issue the same collectives), the best of `repeats` rounds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        comm.barrier(world)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _link_times(comm: Any, world: Any, sizes: ProbeSizes) -> dict[str, float]:
    """Per-call seconds of a small and a large all-reduce and all-gather (full sizes in bytes)."""
    import torch

    n, out = world.size, {}
    for label, nbytes, calls in (("small", 1024 * n, 30), ("large", sizes.comm_mib * 2**20, 3)):
        full, part = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // n)
        ops = {
            "all_reduce": lambda x=full: comm.all_reduce_(x, world),
            "all_gather": lambda o=full, p=part: comm.all_gather_async(o, p, world).wait(),
        }
        for op, fn in ops.items():
            out[f"{op}_{label}"] = _collective_seconds(comm, world, fn, calls, sizes.repeats)
        out[f"{label}_bytes"] = float(full.numel() * 4)
    return out


def _pair(comm: Any, world: Any) -> Any:
    """This rank's pair (0-1, 2-3, ...) as a group; every rank creates every pair's group, in order."""
    import torch.distributed as dist

    pairs = [list(range(r, min(r + 2, world.size))) for r in range(0, world.size, 2)]
    handles = [dist.new_group(ranks) for ranks in pairs]
    mine = dist.get_rank() // 2
    return comm.group("probe_pair", pairs[mine], handles[mine])


def _between_compute(comm: Any, world: Any, sizes: ProbeSizes, message: Callable[[], object]) -> float:
    """Seconds `message` (a collective within the pair) adds when each rank runs a SwiGLU forward
    before it, over and over, against the same compute alone. With more ranks than cores the pair's
    other rank is often descheduled in the middle of its compute (the other pairs run on the cores), and
    the message waits for its turn: about a scheduler time slice, several times the idle latency."""
    import torch

    x, gate, up = (torch.randn(*shape) for shape in ((sizes.rows, sizes.dim), *[(sizes.dim, sizes.ffn)] * 2))
    down = torch.randn(sizes.ffn, sizes.dim)

    def compute() -> None:
        torch.mm(torch.mm(x, gate) * torch.mm(x, up), down)

    def both() -> None:
        compute()
        message()

    # The compute alone in a window (every rank busy throughout: in fixed counts the ranks would drift
    # apart, and the early ones would leave the cores to the late), with its collectives in fixed counts.
    alone = 1.0 / _timed_window(comm, world, [(compute, 1.0)], sizes)
    paired = statistics.median(
        _collective_seconds(comm, world, both, 10, 1) for _ in range(4 * sizes.repeats + 1)
    )
    return max(0.0, paired - alone)


def _loaded_links(comm: Any, world: Any, sizes: ProbeSizes) -> dict[str, float]:
    """Between compute, as training meets them: a tiny all-reduce's latency per message (tensor
    parallel's), and a pair exchange (both send, both receive: a ring hop, a pipeline boundary) at a
    small and a large size."""
    import torch

    pair = _pair(comm, world)
    if pair.size == 1:
        return {"loaded_latency": 0.0, "p2p_small": 0.0, "p2p_large": 0.0}
    peer = 1 - pair.rank
    tiny = torch.zeros(256)
    out = {"loaded_latency": _between_compute(comm, world, sizes, lambda: comm.all_reduce_(tiny, pair)) / 2}
    for label, nbytes in (("small", 4096), ("large", sizes.p2p_kib * 1024)):
        x = torch.zeros(nbytes // 4)
        out[f"p2p_{label}"] = _between_compute(
            comm, world, sizes, lambda x=x: comm.sendrecv(x, pair, peer, peer)[0].wait()
        )
    return out


def rank_probe(threads: int, sizes: ProbeSizes) -> dict[str, float]:
    """Everything one rank measures (run on every rank of a gloo world at once)."""
    import torch
    import torch.distributed as dist

    from meshtron.comm.collectives import Comm
    from meshtron.utils.resident import resident_peak_bytes

    torch.set_num_threads(threads)
    context = float(resident_peak_bytes())
    comm = Comm(timeout_s=120.0)
    world = comm.group("world", list(range(dist.get_world_size())), dist.group.WORLD)
    # One at a time, each call's tensors freed before the next is made (the copy's are large).
    calls = {"matmul": _matmul_suite, "attention": _attention_call, "copy": _copy_call}
    out = {name: _timed_window(comm, world, make(sizes), sizes) for name, make in calls.items()}
    out["optimizer"] = _timed_window(comm, world, _optimizer_call(sizes), sizes)
    if world.size > 1:
        out |= _link_times(comm, world, sizes) | _loaded_links(comm, world, sizes)
    return out | {"context": context}
