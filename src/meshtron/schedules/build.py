"""Pipeline schedules as data: pure functions from (pp, vpp, micro-batches, name) to each rank's actions.

The model is cut into pp·vpp chunks placed on the ranks, and each rank runs a list of forwards,
backwards, weight-gradient computations, sends and receives on them (actions.py). Sends are non-blocking;
a receive blocks until its matching send has run. No torch.distributed here: the same lists drive the
runtime, the simulator (`simulate`) and the pictures.

  gpipe        all forwards, then all backwards
  1f1b         pp - r - 1 warm-up forwards, then one forward / one backward, then the remaining backwards
               (at most pp - r micro-batches in flight on rank r)
  interleaved  Megatron's interleaved 1F1B over vpp chunks per rank (micro-batches a multiple of pp):
               forwards walk pp micro-batches through one chunk, then the next chunk; the bubble
               shrinks by vpp at vpp times the messages
  zero_bubble  ZB-H1 (Qi et al. 2023): backward split into B (input gradient, on the critical path) and
               W (weight gradient, deferrable); rank r delays each W by r micro-batches, so the Ws fill
               the drain's bubble and no rank holds more than 1F1B's rank 0
  zbv          ZB-V and DualPipeV on a V placement (two chunks per rank, vpp = 2: rank r holds chunks r
  dualpipev    and 2·pp − 1 − r): v_shape.py. The hand-off between a rank's own chunks (pp − 1 to
               pp) is a send and receive to itself, which the runtime keeps in memory.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from meshtron.config.schema import V_SCHEDULES, PipelineSchedule
from meshtron.schedules.actions import Action, Kind, rank_of_chunk
from meshtron.schedules.v_shape import dualpipev_order, zbv_order
from meshtron.utils.words import suggest

SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


def schedule_problems(pp: int, vpp: int, microbatches: int | None, name: PipelineSchedule) -> list[str]:
    """What a schedule needs of the pipeline degree, the virtual stages and the micro-batches per step
    (None: not known, so the rule about them is left out)."""
    problems = []
    if name in V_SCHEDULES:
        return _v_problems(pp, vpp, microbatches, name)
    if name != "interleaved" and vpp != 1:
        problems.append(
            f"parallel.vpp={vpp} needs the interleaved schedule (parallel.pp_schedule='interleaved') or a "
            f"V schedule ('zbv', 'dualpipev'; vpp=2)"
        )
    if name == "interleaved" and pp > 1 and vpp < 2:
        problems.append("parallel.pp_schedule='interleaved' needs parallel.vpp >= 2")
    if name == "interleaved" and microbatches is not None and microbatches % pp:
        problems.append(
            f"interleaved 1F1B needs micro-batches per step ({microbatches}) to be a multiple of pp={pp}"
        )
    return problems


def _v_problems(pp: int, vpp: int, microbatches: int | None, name: PipelineSchedule) -> list[str]:
    problems = []
    if vpp != 2:
        problems.append(f"parallel.pp_schedule={name!r} holds two chunks per rank in a V: set parallel.vpp=2")
    least = 2 * pp if name == "dualpipev" else 1
    if microbatches is not None and microbatches < least:
        problems.append(
            f"dualpipev needs at least 2*pp={least} micro-batches per step (it has {microbatches}): raise "
            "training.global_batch or lower training.micro_batch"
        )
    return problems


def check_schedule_args(pp: int, vpp: int, microbatches: int, name: PipelineSchedule) -> None:
    problems = []
    if name not in SCHEDULES:
        problems.append(
            f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}{suggest(name, SCHEDULES)}"
        )
    if pp < 1 or vpp < 1 or microbatches < 1:
        problems.append(f"pp={pp}, vpp={vpp} and microbatches={microbatches} must be positive")
    elif name in SCHEDULES:
        problems += schedule_problems(pp, vpp, microbatches, name)
    if problems:
        raise ValueError("; ".join(problems))


def _compute_order(
    pp: int, vpp: int, m: int, name: PipelineSchedule, rank: int
) -> list[tuple[Kind, int, int]]:
    """The compute actions (kind, chunk, mb) of one rank, in order."""
    if name == "gpipe":
        return [(Kind.F, rank, mb) for mb in range(m)] + [(Kind.B, rank, mb) for mb in range(m)]
    if name == "1f1b":
        warmup = min(pp - rank - 1, m)
        order = [(Kind.F, rank, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [(Kind.F, rank, warmup + i), (Kind.B, rank, i)]
        return order + [(Kind.B, rank, mb) for mb in range(m - warmup, m)]
    if name == "interleaved":
        total = m * vpp

        def forward(k: int) -> tuple[Kind, int, int]:
            group, within = divmod(k, pp * vpp)
            return Kind.F, ((k // pp) % vpp) * pp + rank, group * pp + within % pp

        def backward(k: int) -> tuple[Kind, int, int]:
            group, within = divmod(k, pp * vpp)
            return Kind.B, (vpp - 1 - (k // pp) % vpp) * pp + rank, group * pp + within % pp

        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        return order + [backward(k) for k in range(total - warmup, total)]
    if name == "zbv":
        return zbv_order(pp, m, rank)
    raise ValueError(name)


def _zero_bubble_orders(pp: int, m: int) -> list[list[tuple[Kind, int, int]]]:
    """ZB-H1 (Qi et al. 2023, section 2.1): rank r first runs pp - r forwards, as 1F1B does before its
    first backward, then for each micro-batch i its B, the W of micro-batch i - r (W is delayed by r),
    and its next F; the Ws still delayed run last, where they fill the drain's bubble. Every rank then has pp micro-batches between
    F and W; rank r holds pp - r of them whole and r only as W's inputs, never more than rank 0's pp
    (1F1B's peak). With unit F, B, W the bubble comes out at (pp - 1)·(F + B - W), the paper's figure."""
    orders = []
    for r in range(pp):
        warm_up = min(pp - r, m)
        order = [(Kind.F, r, mb) for mb in range(warm_up)]
        for mb in range(m):
            order.append((Kind.B, r, mb))
            if mb >= r:
                order.append((Kind.W, r, mb - r))
            if warm_up + mb < m:
                order.append((Kind.F, r, warm_up + mb))
        order += [(Kind.W, r, mb) for mb in range(max(0, m - r), m)]
        orders.append(order)
    return orders


def with_p2p(
    order: list[tuple[Kind | str, int, int]],
    rank: int,
    pp: int,
    vpp: int,
    name: PipelineSchedule = "1f1b",
    pairs: Collection[int] = (),
) -> list[Action]:
    """A rank's actions from its compute order [(kind, chunk, mb)]: receives right before the compute
    that needs them, sends right after the compute that makes them (also for orders recorded elsewhere,
    e.g. another runtime's, to simulate them). `name` places the chunks (`rank_of_chunk`). `pairs`: the
    indices of Fs that form an F&B unit with the B and W after them (DualPipeV): both receives before the
    unit; its sends stay after the compute that makes them."""
    last = pp * vpp - 1

    def receive(kind: Kind, chunk: int, mb: int) -> list[Action]:
        if kind == Kind.F and chunk > 0:
            return [Action(Kind.RECV_F, chunk, mb, rank_of_chunk(chunk - 1, pp, name))]
        if kind == Kind.B and chunk < last:
            return [Action(Kind.RECV_B, chunk, mb, rank_of_chunk(chunk + 1, pp, name))]
        return []

    def send(kind: Kind, chunk: int, mb: int) -> list[Action]:
        if kind == Kind.F and chunk < last:
            return [Action(Kind.SEND_F, chunk, mb, rank_of_chunk(chunk + 1, pp, name))]
        if kind == Kind.B and chunk > 0:
            return [Action(Kind.SEND_B, chunk, mb, rank_of_chunk(chunk - 1, pp, name))]
        return []

    actions: list[Action] = []
    steps = [(Kind(kind), chunk, mb) for kind, chunk, mb in order]
    i = 0
    while i < len(steps):
        if i in pairs:
            (f, fc, fm), (b, bc, bm), w = steps[i : i + 3]
            if (f, b, w) != (Kind.F, Kind.B, (Kind.W, bc, bm)):
                raise ValueError(
                    f"rank {rank}: pair at {i} is not an F followed by a full B: {steps[i : i + 3]}"
                )
            actions += [*receive(f, fc, fm), *receive(b, bc, bm), Action(f, fc, fm, paired=True)]
            actions += [*send(f, fc, fm), Action(b, bc, bm), Action(*w), *send(b, bc, bm)]
            i += 3
            continue
        kind, chunk, mb = steps[i]
        actions += [*receive(kind, chunk, mb), Action(kind, chunk, mb), *send(kind, chunk, mb)]
        i += 1
    return actions


def build_schedule(
    pp: int, vpp: int, microbatches: int, name: PipelineSchedule, paired: bool = False
) -> list[list[Action]]:
    """Every rank's ordered actions. `paired` (dualpipev): its F&B pairs as units (`with_p2p`), for a
    runtime that runs each pair's forward and backward at once; else each action in its own turn."""
    if name == "dualpipev":
        check_schedule_args(pp, vpp, microbatches, name)
        built = [dualpipev_order(pp, microbatches, r) for r in range(pp)]
        return [
            with_p2p(order, r, pp, vpp, name, pairs if paired else ())
            for r, (order, pairs) in enumerate(built)
        ]
    orders = compute_orders(pp, vpp, microbatches, name)  # (which checks the arguments)
    return [with_p2p(order, r, pp, vpp, name) for r, order in enumerate(orders)]


def compute_orders(
    pp: int, vpp: int, microbatches: int, name: PipelineSchedule
) -> list[list[tuple[Kind, int, int]]]:
    """Every rank's compute steps (kind, chunk, mb) in order: `build_schedule` without its sends and
    receives (what the planner's memory walk reads)."""
    check_schedule_args(pp, vpp, microbatches, name)
    if name == "zero_bubble":
        return _zero_bubble_orders(pp, microbatches)
    if name == "dualpipev":
        return [dualpipev_order(pp, microbatches, r)[0] for r in range(pp)]
    return [_compute_order(pp, vpp, microbatches, name, r) for r in range(pp)]


def send_release_points(schedule: list[list[Action]], rank: int) -> dict[int, list[tuple[int, int]]]:
    """When `rank` may free each activation it sent (SEND_F): {index of a receive in rank's list:
    [(chunk, mb) of the sends it settles]}. A message from the peer that the peer sent after receiving
    the activation proves the send finished; a backend need not say so by itself (gloo does not).
    Sends no such receive settles are left out (they finish with the step)."""
    received_at = {(a.kind, a.chunk, a.mb): i for i, a in enumerate(schedule[rank]) if a.kind.is_recv}
    points: dict[int, list[tuple[int, int]]] = {}
    for a in schedule[rank]:
        if a.kind != Kind.SEND_F or a.peer == rank:  # a hand-off to this rank's own next chunk
            continue
        peer = schedule[a.peer]
        taken = peer.index(Action(Kind.RECV_F, a.chunk + 1, a.mb, rank))
        for later in peer[taken + 1 :]:
            if later.kind.is_send and later.peer == rank:
                # The receive on `rank` that matches the peer's later send.
                if later.kind == Kind.SEND_F:
                    matching = (Kind.RECV_F, later.chunk + 1, later.mb)
                else:
                    matching = (Kind.RECV_B, later.chunk - 1, later.mb)
                points.setdefault(received_at[matching], []).append((a.chunk, a.mb))
                break
    return points


@dataclass
class Simulation:
    """Result of running action lists with given costs: per-rank (action, start, end) of compute actions."""

    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    bubble_fraction: float  # idle share of pp x makespan
    # Per rank, the most micro-batches between forward and (input-gradient) backward at once: the
    # activations backward needs. A zero-bubble W needs only each linear layer's input and output grad.
    peak_in_flight: list[int]


def _check_matching(schedule: list[list[Action]]) -> None:
    """Every send has the receive that takes it on its peer, and every receive has its send."""
    sends = {
        (a.kind.carries, a.chunk, a.mb, r, a.peer)
        for r, acts in enumerate(schedule)
        for a in acts
        if a.kind.is_send
    }
    recvs = {
        (a.kind.carries, a.source_chunk, a.mb, a.peer, r)
        for r, acts in enumerate(schedule)
        for a in acts
        if a.kind.is_recv
    }
    if sends != recvs:
        raise ValueError(
            f"unmatched sends/receives: sends without receive {sorted(sends - recvs)[:3]}, "
            f"receives without send {sorted(recvs - sends)[:3]}"
        )


def _check_order(rank: int, a: Action, done: Mapping[tuple[Kind, int, int], float]) -> None:
    if a.kind in (Kind.B, Kind.W) and (Kind.F, a.chunk, a.mb) not in done:
        raise ValueError(f"rank {rank}: {a} runs before the forward of chunk {a.chunk} mb {a.mb}")
    if a.kind == Kind.W and (Kind.B, a.chunk, a.mb) not in done:
        raise ValueError(f"rank {rank}: {a} runs before its input-gradient backward")


_LIVE = {Kind.F: 1, Kind.B: -1, Kind.W: 0}  # a forward keeps activations alive until its backward


@dataclass(frozen=True)
class CheckedSchedule:
    """Action lists whose sends and receives match, with what the simulator does for each action
    (whether it deadlocks or runs a backward early is checked when it is first simulated). Simulating
    one many times with different costs (the planner does) skips the list walks."""

    schedule: list[list[Action]]
    steps: list[list[tuple[str, tuple[Kind, int, int]]]]
    split: bool  # has W actions


def _step(a: Action) -> tuple[str, tuple[Kind, int, int]]:
    """What the simulator does with an action, and the key it records or waits on."""
    if a.kind.is_recv:
        return "recv", (a.kind.carries, a.source_chunk, a.mb)
    if a.kind.is_send:
        return "send", (a.kind.carries, a.chunk, a.mb)
    return "compute", (a.kind, a.chunk, a.mb)


def checked_schedule(schedule: list[list[Action]]) -> CheckedSchedule:
    """`schedule` with its send/receive matching checked and its deadlock and order checked by a run at
    unit costs; raises ValueError naming the problem."""
    _check_matching(schedule)
    steps = [[_step(a) for a in actions] for actions in schedule]
    checked = CheckedSchedule(schedule, steps, any(a.kind == Kind.W for actions in schedule for a in actions))
    _run(checked, lambda kind, chunk: 1.0, verify=True)
    return checked


def simulate(
    schedule: list[list[Action]] | CheckedSchedule,
    cost_f: float = 1.0,
    cost_b: float = 2.0,
    cost_w: float = 0.0,
    vpp: int = 1,
    chunk_costs: Mapping[tuple[Kind, int], float] | None = None,
) -> Simulation:
    """Execute the lists (compute takes its cost, a chunk's cost is 1/vpp of a stage's; sends take no time;
    a receive waits for its send). Checks every backward follows its forward, every send has a matching
    receive, and that the lists cannot deadlock; raises ValueError naming the problem otherwise.

    For schedules without W actions, cost_b is the whole backward; with them, B costs cost_b - cost_w.
    `chunk_costs[(kind, chunk)]`, when given, is every action's own cost instead (e.g. measured ones)."""
    checked = schedule if isinstance(schedule, CheckedSchedule) else checked_schedule(schedule)
    costs = {
        Kind.F: cost_f / vpp,
        Kind.B: (cost_b - (cost_w if checked.split else 0.0)) / vpp,
        Kind.W: cost_w / vpp,
    }
    if chunk_costs is not None:
        return _run(checked, lambda kind, chunk: chunk_costs[kind, chunk], verify=False)
    return _run(checked, lambda kind, chunk: costs[kind], verify=False)


def _run(checked: CheckedSchedule, cost: Callable[[Kind, int], float], verify: bool) -> Simulation:
    schedule, steps, pp = checked.schedule, checked.steps, len(checked.schedule)
    position, clock = [0] * pp, [0.0] * pp
    sent: dict[tuple[Kind, int, int], float] = {}
    done: dict[tuple[Kind, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    alive, peak = [0] * pp, [0] * pp
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r in range(pp):
            while position[r] < len(schedule[r]):
                what, key = steps[r][position[r]]
                if what == "recv":
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif what == "send":
                    sent[key] = clock[r]
                else:
                    a = schedule[r][position[r]]
                    if verify:
                        _check_order(r, a, done)
                    seconds = cost(key[0], key[1])
                    timeline[r].append((a, clock[r], clock[r] + seconds))
                    clock[r] += seconds
                    done[key] = clock[r]
                    alive[r] += _LIVE[key[0]]
                    peak[r] = max(peak[r], alive[r])
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule[r][position[r]]) for r in range(pp) if position[r] < len(schedule[r])}
            raise ValueError(f"deadlock: ranks wait on receives that are never sent: {stuck}")
    return Simulation(timeline, max(clock), idle_fraction(timeline), peak)


def busy_seconds(rank_timeline: list[tuple[Action, float, float]]) -> float:
    """How long a rank computed: the union of its actions' spans (a pair's F and B may overlap)."""
    busy, reached = 0.0, float("-inf")
    for _, start, end in sorted(rank_timeline, key=lambda span: span[1]):
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return busy


def idle_fraction(timeline: list[list[tuple[Action, float, float]]]) -> float:
    """The bubble: the share of ranks x step time (until the last compute ends) spent not computing."""
    makespan = max(end for rank in timeline for _, _, end in rank)
    busy = sum(busy_seconds(rank) for rank in timeline)
    return 1 - busy / (len(timeline) * makespan)
