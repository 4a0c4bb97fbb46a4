"""Persistent communication buffers, taken in turn, so that a steady-state step allocates none.

A fresh buffer per collective costs a page fault per 4 KiB page on first touch (thousands a step on
CPU) and a trip through the allocator. `Staging` keeps two buffers per dtype of the largest size asked
for, and hands them out alternately: a caller taking a buffer first finishes the collective of whoever
took it two turns before (the callback that user left with `hold`). A group's collectives run in the
order they were issued (gloo and NCCL both), so that one is already done or next in line, and waiting
for it costs nothing the step would not wait for anyway.

ZeRO-1/2 (zero.py) stage the reduce-scatter's packed input and the all-gather's output here; ZeRO-3
(fsdp.py) its gathered blocks and their reduce-scatter inputs, one `Staging` each, since those two kinds
interleave in backward. A request larger than the kept size (ZeRO-3's root unit: embedding and head,
often several blocks' worth) gets a buffer of its own, so what is kept stays a few blocks' worth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Staging:
    """Two `numel`-element buffers per dtype, taken in turn."""

    def __init__(self, numel: int, device: torch.device):
        self.numel, self.device = numel, device
        self.buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self.users: list[Callable[[], None] | None] = [None, None]
        self.turn = 0
        self.oversized = False  # the last `take` was larger than the kept buffers

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next buffer's first `numel` elements, once its previous user's collective is finished;
        past the kept size, a fresh buffer of its own (freed with its last use; `hold` then ignores it)."""
        self.oversized = numel > self.numel
        if self.oversized:
            return torch.empty(numel, dtype=dtype, device=self.device)
        slot, self.turn = self.turn, 1 - self.turn
        if (previous := self.users[slot]) is not None:
            self.users[slot] = None
            previous()
        if dtype not in self.buffers:
            self.buffers[dtype] = [torch.empty(self.numel, dtype=dtype, device=self.device) for _ in range(2)]
        return self.buffers[dtype][slot][:numel]

    def hold(self, finish: Callable[[], None]) -> None:
        """The buffer taken last is in use until `finish` has run."""
        if not self.oversized:
            self.users[1 - self.turn] = finish

    def drain(self) -> None:
        """Finish every collective still using a buffer."""
        for slot, finish in enumerate(self.users):
            if finish is not None:
                self.users[slot] = None
                finish()
