"""A named process group, and the error a collective that does not complete raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: names who was waiting, on what, in which group."""


@dataclass(frozen=True)
class CommGroup:
    """A process group with the name of its mesh dim and the global ranks in it."""

    name: str
    ranks: tuple[int, ...]
    process_group: Any = field(repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())
