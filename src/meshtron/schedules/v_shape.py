"""V-shaped pipeline schedules: each rank holds two chunks, down and back up the pipeline.

With 2·pp chunks, rank r holds chunk r (on the way down) and chunk 2·pp − 1 − r (on the way back), so
the first and last chunks (embedding, head and loss) sit on rank 0, and the middle hand-off (chunk
pp − 1 to chunk pp) stays on rank pp − 1. Backward starts on rank 0 as soon as a micro-batch has been
down and up: the warm-up is short, so few activations wait, and the split backward (B now, W later)
fills what is left of the bubble. Costs below are per chunk (half a stage); B is the input gradient, W
the weight gradient, and a "full" backward is a B with its W right after it.

  zbv        ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 4): on rank r,
               warm-up   2·(pp−r)−1 F of the down chunk; r × (F up, F down); pp−r × (F up, B up, W up)
               steady    (F down, B down, W down, F up, B up, W up) while forwards remain
               cool-down r × (B down, B up); pp−r × (B down, W down); the Ws left, up chunk first
             bubble (pp−1)·(F + B − 2W) per rank (0 when F = B = W), at 1F1B's activation memory
             (at most 2·pp chunk activations: pp stages' worth)
  dualpipev  DualPipeV (DeepSeek-V3 technical report, 2024: DualPipe cut in half onto a V): a forward of
             one micro-batch paired with the full backward of another (F&B), so that one's
             communication (the MoE all-to-alls) can hide behind the other's compute; on rank r,
               1  2·(pp−r−1) F down                    5  pp−r−1 × (full B up, F&B: F up + B down)
               2  r+1 × (F down, F up)                 6  r+1 × (B up, B down): full in the first
               3  pp−r−1 × (B up, a W, F up)              half, input-gradient only after it
               4  m−2·pp+r+1 × (F&B: F down + B up,    7  pp−r−1 × (a W, B down)
                  F&B: F up + B down)                  8  r+1 × (a W)
             bubble (pp−1)·(F&B + B − 3W) per rank (B: a full backward), activations of pp+1 micro-
             batches at most; needs at least 2·pp micro-batches. `dualpipev_order` also returns where its
             F&B pairs are; with `build_schedule(..., paired=True)` each is one unit, both of its
             receives first, which the runtime runs at once (pipeline/pairs.py). Waiting for both inputs costs
             (pp−1)·F once per step where nothing overlaps; the overlap is what buys it back.
"""

from __future__ import annotations

from collections import deque

from meshtron.schedules.actions import Kind

Order = list[tuple[Kind, int, int]]


class _RankOrder:
    """A rank's compute order, built action by action with per-(kind, chunk) micro-batch counters and
    the input-gradient backwards whose W is still to come."""

    def __init__(self, microbatches: int):
        self.m = microbatches
        self.order: Order = []
        self.count: dict[tuple[Kind, int], int] = {}
        self.deferred: deque[tuple[int, int]] = deque()  # (chunk, mb) of Bs whose W waits
        self.pairs: set[int] = set()  # order indices of the Fs run together with the full B after them

    def started(self, kind: Kind, chunk: int) -> int:
        """How many micro-batches of `chunk` have had their `kind` action added."""
        return self.count.get((kind, chunk), 0)

    def _add(self, kind: Kind, chunk: int) -> None:
        mb = self.started(kind, chunk)
        self.order.append((kind, chunk, mb))
        self.count[kind, chunk] = mb + 1
        if kind == Kind.B:
            self.deferred.append((chunk, mb))

    def forward(self, chunk: int) -> None:
        if self.started(Kind.F, chunk) < self.m:
            self._add(Kind.F, chunk)

    def backward(self, chunk: int, full: bool = False) -> None:
        """B of the chunk's oldest micro-batch not yet back-propagated (if its forward ran); `full`: with
        its W at once."""
        if self.started(Kind.B, chunk) < self.started(Kind.F, chunk):
            self._add(Kind.B, chunk)
            if full:
                self.order.append((Kind.W, *self.deferred.pop()))

    def forward_and_backward(self, f_chunk: int, b_chunk: int) -> None:
        """F&B: a forward of `f_chunk` and the full backward of `b_chunk` (another micro-batch), marked as
        a pair when both are left to run (the runtime may run the two at once)."""
        if self.started(Kind.F, f_chunk) < self.m and self.started(Kind.B, b_chunk) < self.started(
            Kind.F, b_chunk
        ):
            self.pairs.add(len(self.order))
        self.forward(f_chunk)
        self.backward(b_chunk, full=True)

    def weights(self, chunk: int | None = None) -> None:
        """The W of the oldest deferred B (of `chunk`, if given)."""
        for i, (c, mb) in enumerate(self.deferred):
            if chunk is None or c == chunk:
                del self.deferred[i]
                self.order.append((Kind.W, c, mb))
                return

    def one_f_one_b(self, chunk: int) -> None:
        """F, B and W of `chunk` in a row (ZB-V's steady state)."""
        self.forward(chunk)
        self.backward(chunk)
        self.weights(chunk)

    def finish(self, down: int, up: int) -> Order:
        """Whatever the phases left (few micro-batches): backwards up chunk first, then the Ws."""
        while self.started(Kind.B, up) < self.m or self.started(Kind.B, down) < self.m:
            self.backward(up)
            self.backward(down)
        while self.deferred:
            self.weights()
        return self.order


def v_chunks(rank: int, pp: int) -> tuple[int, int]:
    """(down, up): the two chunks rank `rank` holds in a V over 2·pp chunks."""
    return rank, 2 * pp - 1 - rank


def zbv_order(pp: int, m: int, rank: int) -> Order:
    down, up = v_chunks(rank, pp)
    o = _RankOrder(m)
    for _ in range(2 * (pp - rank) - 1):
        o.forward(down)
    for _ in range(rank):
        o.forward(up)
        o.forward(down)
    for _ in range(pp - rank):
        o.one_f_one_b(up)
    while o.started(Kind.F, down) < m or o.started(Kind.F, up) < o.started(Kind.F, down):
        o.one_f_one_b(down)
        o.one_f_one_b(up)
    for _ in range(rank):
        o.backward(down)
        o.backward(up)
    for _ in range(pp - rank):
        o.backward(down)
        o.weights(down)
    for chunk in (up, down):
        while any(c == chunk for c, _ in o.deferred):
            o.weights(chunk)
    return o.finish(down, up)


def dualpipev_order(pp: int, m: int, rank: int) -> tuple[Order, frozenset[int]]:
    """Rank `rank`'s compute order and the indices in it of the Fs paired with the B (and W) after them."""
    down, up = v_chunks(rank, pp)
    o = _RankOrder(m)
    for _ in range(2 * (pp - rank - 1)):
        o.forward(down)
    for _ in range(rank + 1):
        o.forward(down)
        o.forward(up)
    for _ in range(pp - rank - 1):
        o.backward(up)
        o.weights()
        o.forward(up)
    for _ in range(m - 2 * pp + rank + 1):  # the paired phase: F of one micro-batch, full B of another
        o.forward_and_backward(down, up)
        o.forward_and_backward(up, down)
    for _ in range(pp - rank - 1):
        o.backward(up, full=True)
        o.forward_and_backward(up, down)
    split_from = (rank + 1) // 2  # the cool-down's second half leaves its Ws for the gaps after it
    for i in range(rank + 1):
        o.backward(up, full=i < split_from + (rank % 2 == 0))
        o.backward(down, full=i < split_from)
    for _ in range(pp - rank - 1):
        o.weights()
        o.backward(down)
    for _ in range(rank + 1):
        o.weights()
    return o.finish(down, up), frozenset(o.pairs)
