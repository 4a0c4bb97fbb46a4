"""DualPipeV's F&B pairs run at once: one micro-batch's forward while another's backward runs.

DeepSeek-V3's DualPipe pairs the forward of one micro-batch with the backward of another on each rank,
so that the expert all-to-alls of one hide behind the compute of the other. With `parallel.pp_overlap`
on, the runtime runs a pair (an F marked `paired` in the schedule, and the B and W after it) like this:

  1  both messages the pair needs are received first (the schedule puts both receives before it)
  2  the forward starts in a helper thread, which issues every collective on the comm layer's *pair
     lane*: a twin of each process group a forward uses (tp, cp, ep; mesh.py `pair_lane`), so that
     each group still sees its collectives in one order on every rank, per lane
  3  this thread runs the backward and the W, on the groups themselves
  4  both threads are joined; then the pair's sends go out

While one thread waits in an all-to-all (the wait releases the interpreter lock, and the backend moves
the bytes), the other computes. CPU (gloo) only for now: on a GPU both threads would launch onto one
stream, behind the same NCCL waits, and NCCL asks every rank to post concurrent work on several
communicators in one order; a stream of its own for the forward is the next step.

What must not be shared between the two threads is kept per thread: the weight-gradient deferral modes
(zero_bubble.py) and whether expert loads are counted (models/moe.py). What cannot be shared at all is
refused: ZeRO-3's parameter units are gathered and freed by both a forward and a backward, and compiled
blocks are not run from two threads at once here. ZeRO-1/2 are safe because every chunk runs a forward
on the main thread before the first pair (the warm-up), which waits for their deferred parameter
gathers; a forward that communicated on a group without a twin (dp) would fail loudly (comm.py). The
helper thread is fresh, so a context a caller enters around `PipelineRuntime.run` (a mode, autocast)
does not reach the paired forwards; nothing in meshtron does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from meshtron.comm import Comm
from meshtron.pipeline.actions import Action, Kind


def run_pair(comm: Comm, forward: Callable[[], object], backward: Callable[[], object]) -> None:
    """`forward` in a helper thread on `comm`'s pair lane while `backward` runs in this one; returns when
    both are done and raises what either raised (the backward's first)."""
    failures: list[BaseException] = []

    def run_forward() -> None:
        try:
            with comm.pair_lane():
                forward()
        except BaseException as err:  # re-raised in the calling thread below
            failures.append(err)

    helper = threading.Thread(target=run_forward, name="meshtron-pair-forward", daemon=True)
    helper.start()
    try:
        backward()
    finally:
        helper.join()
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
