"""What a pipeline schedule is made of: chunks placed on ranks, and the actions a rank runs on them.

The model is cut into pp·vpp chunks; rank r holds chunks r, r + pp, r + 2·pp, ... (one per virtual
stage), or under a V schedule chunks r and 2·pp − 1 − r. An action is a forward F, a backward B (input
and weight gradient together, or only the input gradient when the schedule splits it), a weight-gradient
W, or a point-to-point send / receive of an activation (..._F) or its gradient (..._B) between
neighbouring chunks. Pure data: build.py builds lists of actions, the runtime runs them, the simulator
and the pictures read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshtron.config.schema import V_SCHEDULES, PipelineSchedule


def rank_of_chunk(chunk: int, pp: int, name: PipelineSchedule) -> int:
    """The rank holding global chunk `chunk`: round-robin (r, r + pp, ...), or in a V for V schedules."""
    if name in V_SCHEDULES:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def chunks_of_rank(rank: int, pp: int, vpp: int, name: PipelineSchedule) -> list[int]:
    """The global chunk indices rank `rank` holds, in forward order."""
    if name in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [v * pp + rank for v in range(vpp)]


class Kind(str, enum.Enum):
    """What an action does. A send or receive carries the activation of a forward (..._F) or the
    gradient of a backward (..._B) between neighbouring chunks."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)

    @property
    def carries(self) -> Kind:
        """For a send or receive, the compute whose result travels: F (activation) or B (gradient)."""
        if self.is_compute:
            raise ValueError(f"{self} is a computation, not a message")
        return Kind.F if self in (Kind.SEND_F, Kind.RECV_F) else Kind.B

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    """`kind` (a Kind, or its name); `chunk` is the global chunk (stage) index; for sends and receives,
    `peer` is the other rank. `paired`, on an F only: DualPipeV's F&B, this forward and the B and W right
    after it (another chunk, another micro-batch) are one unit, which the runtime may run at once: the
    receives of both come before the F (the runtime sends the F's output once the unit is done)."""

    kind: Kind
    chunk: int
    mb: int
    peer: int = -1
    paired: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        pair = "&" if self.paired else ""
        return f"{self.kind.value}{self.chunk}.{self.mb}{pair}" + (f"@{self.peer}" if self.peer >= 0 else "")

    @property
    def source_chunk(self) -> int:
        """For a receive, the chunk whose send it takes: the one before (forward) or after (backward)."""
        if not self.kind.is_recv:
            raise ValueError(f"{self} is not a receive")
        return self.chunk - 1 if self.kind == Kind.RECV_F else self.chunk + 1


# The step phase each compute action's time counts in (comm/timing.py), and the words a profiler span uses.
ACTION_PHASES = {Kind.F: "forward", Kind.B: "backward", Kind.W: "backward"}
_SPAN_WORDS = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.W: "weight gradients",
    Kind.SEND_F: "send activations",
    Kind.RECV_F: "receive activations",
    Kind.SEND_B: "send gradients",
    Kind.RECV_B: "receive gradients",
}


def action_span(a: Action) -> str:
    """A trace's name for action `a`: "forward chunk 1 micro-batch 3", "send gradients chunk 2
    micro-batch 0 to rank 1"."""
    peer = f" {'to' if a.kind.is_send else 'from'} rank {a.peer}" if a.peer >= 0 else ""
    return f"{_SPAN_WORDS[a.kind]} chunk {a.chunk} micro-batch {a.mb}{peer}"
