"""DualPipeV's F&B pairs run at once: one micro-batch's forward while another's backward runs.

DeepSeek-V3's DualPipe pairs the forward of one micro-batch with the backward of another on each rank,
so that the expert all-to-alls of one hide behind the compute of the other. With `parallel.pp_overlap`
on, the runtime runs a pair (an F marked `paired` in the schedule, and the B and W after it) like this:

  1  both messages the pair needs are received first (the schedule puts both receives before it)
  2  the forward starts in a helper thread, which issues every collective on the comm layer's *pair
     lane*: a twin of each process group a forward uses (tp, cp, ep; comm/mesh.py `pair_lane`), so that
     each group still sees its collectives in one order on every rank, per lane
  3  this thread runs the backward and the W, on the groups themselves
  4  both threads are joined; then the pair's sends go out

While one thread waits in an all-to-all (the wait releases the interpreter lock, and the backend moves
the bytes), the other computes.

On CUDA the paired forward runs on a stream of its own (one per device, `side_stream`): on the one
stream both threads would share, `work.wait()` of the forward's all-to-all would hold the backward's
kernels queued behind it too. Around a pair:

  before   the side stream waits for the main one (the pair's received inputs, everything before)
  forward  kernels on the side stream; every tensor it saves for backward is marked as used by the
           main stream (`record_stream`): its backward runs there later, and the caching allocator
           must not hand the memory to the side stream again before that work is done
  after    the main stream waits for the side one (the pair's sends and later actions read its outputs)

The forward's outputs are released between actions (after their sends are waited on), never during a
pair, and the next pair's side stream waits for the main one first, so their memory is safe without a
mark. NCCL: each lane's collectives go to its own communicators (the twins), in one order per lane on
every rank; the two lanes' kernels may then interleave differently on different ranks, which NCCL
tolerates while both fit on the GPU at once (its kernels take a few SMs each). What needs two GPUs or
more (the NCCL ordering, the overlap itself) is not verified yet, so on CUDA the runtime refuses
`parallel.pp_overlap` unless MESHTRON_UNVERIFIED_PAIR_LANE=1 (rules/pipeline.py); the streams alone are
checked on one GPU by benchmarks/gpu_check.py.

What must not be shared between the two threads is kept per thread: the weight-gradient deferral modes
(zero_bubble.py) and whether expert loads are counted (models/moe.py). What cannot be shared at all is
refused: ZeRO-3's parameter units are gathered and freed by both a forward and a backward, and compiled
blocks are not run from two threads at once here. ZeRO-1/2 are safe because every chunk runs a forward
on the main thread before the first pair (the warm-up), which waits for their deferred parameter
gathers; a forward that communicated on a group without a twin (dp) would fail loudly (comm/counted.py). The
helper thread is fresh, so a context a caller enters around `PipelineRuntime.run` (a mode, autocast)
does not reach the paired forwards; nothing in meshtron does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from meshtron.comm.collectives import Comm
from meshtron.schedules.actions import Action, Kind

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream paired forwards run on, one per CUDA device (made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@contextlib.contextmanager
def on_side_stream(side: torch.cuda.Stream | None, main: torch.cuda.Stream | None) -> Iterator[None]:
    """In this thread: kernels on `side`, every tensor autograd saves marked as used by `main` (where its
    backward will read it). Nothing to do without a side stream (CPU)."""
    if side is None:
        yield
        return

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            t.record_stream(main)
        return t

    with torch.cuda.stream(side), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def run_pair(
    comm: Comm,
    forward: Callable[[], object],
    backward: Callable[[], object],
    device: torch.device | None = None,
) -> None:
    """`forward` in a helper thread on `comm`'s pair lane (on CUDA: on the side stream) while `backward`
    runs in this one; returns when both are done and raises what either raised (the backward's first)."""
    failures: list[BaseException] = []
    cuda = device is not None and device.type == "cuda"
    side, main = (side_stream(device), torch.cuda.current_stream(device)) if cuda else (None, None)
    if side is not None:
        side.wait_stream(main)

    def run_forward() -> None:
        try:
            with comm.pair_lane(), on_side_stream(side, main):
                forward()
        except BaseException as err:  # re-raised in the calling thread below
            failures.append(err)

    helper = threading.Thread(target=run_forward, name="meshtron-pair-forward", daemon=True)
    helper.start()
    try:
        backward()
    finally:
        helper.join()
        if side is not None:
            main.wait_stream(side)
    if failures:
        raise failures[0]


Span = tuple[float, float]


def _overlap(spans: list[Span], others: list[Span]) -> float:
    return sum(max(0.0, min(e, oe) - max(s, os)) for s, e in spans for os, oe in others)


def _minus(spans: list[Span], holes: list[Span]) -> list[Span]:
    for hs, he in holes:
        spans = [
            piece for s, e in spans for piece in ((s, min(e, hs)), (max(s, he), e)) if piece[1] > piece[0]
        ]
    return spans


def hidden_exchanges(
    timeline: list[tuple[Action, float, float]], waits: list[tuple[str, str, str, float, float]]
) -> tuple[float, float, float]:
    """From one rank's step (the runtime's `timeline` and `comm_timeline`): (seconds the pairs' forwards
    waited in all-to-alls, of those the seconds inside their forward's span, of those the seconds during
    which the pair's backward was computing, i.e. in its B or W and not waiting itself)."""
    forwards = [(s, e) for a, s, e in timeline if a.paired]
    backwards = [(s, e) for a, s, e in timeline if a.kind != Kind.F and _overlap([(s, e)], forwards)]
    exchanges = [(s, e) for op, _, lane, s, e in waits if lane == "pair" and op == "all_to_all"]
    own_waits = [(s, e) for _, _, lane, s, e in waits if lane == "main"]
    computing = _minus(backwards, own_waits)
    return sum(e - s for s, e in exchanges), _overlap(exchanges, forwards), _overlap(exchanges, computing)
