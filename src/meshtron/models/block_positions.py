"""A block's global positions as runs of consecutive ones, known on the host.

Blockwise attention (blockwise_attention.py) plans its tiles from the positions of a block's queries
and keys: where each run of consecutive query positions begins, which keys a tile can see, where the
fused kernel's causal square lies. Kept as Python integers, that planning reads nothing from the device
(on a GPU every read is a synchronisation). The tensor exists on the device only for the masks, built
there by one `arange` per run (no copy from the host), and is cached per device.

Positions rise along the rows: a context-parallel rank holds one run, or two under load balancing (its
chunk and the mirror one), and the keys a ring step visits are another rank's, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Positions:
    """The rows' positions: runs of (first position, length), in row order, rising."""

    runs: tuple[tuple[int, int], ...]
    _on: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def arange(cls, start: int, stop: int) -> Positions:
        return cls(((start, stop - start),) if stop > start else ())

    @classmethod
    def of(cls, pos: torch.Tensor) -> Positions:
        """From a tensor of rising positions (reads it: for callers that have only the tensor)."""
        runs: list[list[int]] = []
        for p in pos.tolist():
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        return cls(tuple((first, n) for first, n in runs))

    def __len__(self) -> int:
        return sum(n for _, n in self.runs)

    def __getitem__(self, rows: slice) -> Positions:
        """The rows [start, stop) (a slice without a step)."""
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("Positions take slices without a step")
        runs, offset = [], 0
        for first, n in self.runs:
            lo, hi = max(start, offset), min(stop, offset + n)
            if hi > lo:
                runs.append((first + lo - offset, hi - lo))
            offset += n
        return Positions(tuple(runs))

    def segments(self) -> list[tuple[int, int]]:
        """[begin, end) rows of each run."""
        out, offset = [], 0
        for _, n in self.runs:
            out.append((offset, offset + n))
            offset += n
        return out

    def at(self, row: int) -> int:
        for first, n in self.runs:
            if row < n:
                return first + row
            row -= n
        raise IndexError("row beyond the positions")

    def first(self) -> int:
        return self.runs[0][0]

    def last(self) -> int:
        first, n = self.runs[-1]
        return first + n - 1

    def count_upto(self, position: int) -> int:
        """How many rows have a position <= `position` (positions rise, so they are the first ones)."""
        return sum(min(n, max(0, position - first + 1)) for first, n in self.runs)

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The positions as an int64 tensor on `device`: one arange per run, made once per device."""
        device = torch.device(device)
        if device not in self._on:
            parts = [torch.arange(first, first + n, device=device) for first, n in self.runs]
            self._on[device] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
        return self._on[device]


def as_positions(pos: Positions | torch.Tensor) -> Positions:
    return pos if isinstance(pos, Positions) else Positions.of(pos)
