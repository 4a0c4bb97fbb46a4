"""Collective outputs kept for a recomputed forward, so that its rerun in backward does not send again.

Per-op recompute (parallel/recompute.py) reruns each block's forward in backward and takes the outputs its
policy kept from torch's selective-checkpoint store. That store sees torch operations only; meshtron's
collectives are c10d calls on buffers, so without this module the rerun would issue them again: the
expert dispatch's exchanges a second time, over the network, for rows that already arrived once.

  forward  inside `keeping(store)`: each collective issued inside a `reusable()` region puts its output
           in the store, in issue order
  rerun    inside `replaying(store)`: the same region's collectives, in the same order, take the kept
           outputs instead; nothing is sent, waited on or counted
  else     collectives run as always (outside a checkpoint, or under full recompute: it keeps nothing)

A caller marks which collectives may be kept, and as what kind; a store keeps the kinds it is made for:

  "dispatch"  the expert dispatch's forward exchanges (count table, token rows, their gates, ids and
              masks: parallel/expert.py), whose outputs the experts' matmuls read; the combine after the
              experts is not marked (the rerun stops before it). Per MoE layer and micro-batch in flight,
              one copy of what the dispatch delivered to this rank (plan/memory.py prices it);
              `training.op_recompute_dispatch = "rerun"` leaves it out of the store
  "tp"        sequence parallel's reduce-scatter after the attention's output projection (parallel/
              tensor.py), whose output the rest of the block reads: T·h/tp per layer. torchtitan's per-op
              policy keeps its reduce-scatters' outputs likewise (functional collectives, which torch's
              store sees); the FFN's and MoE's exits end the block, past where the rerun stops

Every rank reruns the same blocks with the same code, so the ranks of a group skip the same collectives
and none waits on a partner that replays. State is per thread (a DualPipeV pair reruns one block's
forward in backward while the other thread runs a forward that keeps).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


class KeptOutputs:
    """One checkpointed block's kept collective outputs, in issue order, each with what the call was
    (a rerun that asks for another call is refused) and its version at keeping (an output changed in
    place afterwards would replay wrong values: refused)."""

    def __init__(self, kinds: frozenset[str] = frozenset({"dispatch", "tp"})) -> None:
        self.kinds = kinds
        self.outputs: list[tuple[torch.Tensor, int, tuple]] = []
        self.next = 0

    def keep(self, out: torch.Tensor, call: tuple) -> None:
        # A detached alias: the collective's autograd node then sets its history on `out`, not on this.
        self.outputs.append((out.detach(), out._version, call))

    def take(self, call: tuple) -> torch.Tensor:
        if self.next >= len(self.outputs):
            raise RuntimeError(
                f"a recomputed forward issued more reusable collectives ({self.next + 1}) than its forward "
                f"kept ({len(self.outputs)}): the rerun took another path than the forward"
            )
        kept, version, forward_call = self.outputs[self.next]
        if call != forward_call:
            raise RuntimeError(
                f"reusable collective #{self.next} of the rerun is {call}, the forward's was {forward_call}: "
                "the rerun took another path than the forward"
            )
        if kept._version != version:
            raise RuntimeError(
                f"reusable collective output #{self.next} was changed in place after the forward kept it: "
                "a rerun would replay wrong values (copy it before changing it)"
            )
        self.next += 1
        return kept.detach()  # a fresh alias per rerun, for that rerun's autograd node


class _State(threading.local):
    store: KeptOutputs | None = None
    replay = False
    kind: str | None = None  # the innermost `reusable()` region's


_STATE = _State()


@contextlib.contextmanager
def _set(store: KeptOutputs | None, replay: bool) -> Iterator[None]:
    before = _STATE.store, _STATE.replay, _STATE.kind
    _STATE.store, _STATE.replay, _STATE.kind = store, replay, None
    if replay and store is not None:
        store.next = 0  # each rerun replays from the first
    try:
        yield
    finally:
        _STATE.store, _STATE.replay, _STATE.kind = before


def keeping(store: KeptOutputs) -> contextlib.AbstractContextManager:
    """A forward that keeps the outputs of its reusable collectives in `store`."""
    return _set(store, replay=False)


def replaying(store: KeptOutputs) -> contextlib.AbstractContextManager:
    """A rerun of that forward: its reusable collectives take their outputs from `store`, from the first."""
    return _set(store, replay=True)


@contextlib.contextmanager
def reusable(kind: str) -> Iterator[None]:
    """Collectives issued inside may be kept for a rerun (and are replayed there) by a store that keeps
    `kind` ("dispatch" or "tp")."""
    before, _STATE.kind = _STATE.kind, kind
    try:
        yield
    finally:
        _STATE.kind = before


def kept_or_issued(call: tuple, issue: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`issue()`'s output; inside a reusable region, kept for the rerun, or in the rerun taken from the
    store without issuing anything. `call` says what is issued (the collective, its group, the input's
    shape and splits): the rerun's must be the forward's."""
    store = _STATE.store
    if store is None or _STATE.kind not in store.kinds:
        return issue()
    if _STATE.replay:
        return store.take(call)
    out = issue()
    store.keep(out, call)
    return out
