"""The planner's activation and transient memory against independent counts: the pipeline walk against
the schedule simulator's in-flight count (and the published 1F1B / GPipe closed forms), zero-bubble's
waiting weight gradients, and the step's transients. benchmarks/memory_vs_plan.py measures the whole
against each rank's resident peak (docs/planner.md)."""

from __future__ import annotations

import pytest

from meshtron.commands.dry_run import resolved
from meshtron.config.schema import SPLIT_BACKWARD
from meshtron.plan.gpu_memory import (
    MemoryOverhead,
    alive_counts,
    chunk_activation_bytes,
    optimizer_transient_bytes,
    peak_of,
    schedule_activation_bytes,
    stage_memory,
    waiting_weight_grad_bytes,
    walked_micro_batches,
)
from meshtron.plan.state import layer_split
from meshtron.rules.checks import load_config
from meshtron.schedules.actions import Kind, chunks_of_rank
from meshtron.schedules.build import build_schedule, compute_orders, simulate
from meshtron.testing.tiny import TINY

NONE = MemoryOverhead(context_bytes=0.0, fragmentation=0.0)


def pipeline_cfg(pp: int, vpp: int, schedule: str, micro: int, layers: int = 8):
    return resolved(
        load_config(
            None,
            [
                *TINY,
                f"--model.n_layers={layers}",
                f"--parallel.pp={pp}",
                f"--parallel.vpp={vpp}",
                f"--parallel.pp_schedule={schedule}",
                "--training.micro_batch=1",
                f"--training.global_batch={micro}",
            ],
        ),
        pp,
    )


@pytest.mark.parametrize(
    "pp,vpp,schedule,micro",
    [
        (4, 1, "1f1b", 8),
        (4, 1, "1f1b", 3),
        (4, 1, "gpipe", 6),
        (2, 2, "interleaved", 4),
        (4, 2, "interleaved", 8),
    ],
)
def test_walk_holds_the_simulators_in_flight_chunks(pp, vpp, schedule, micro):
    """Uniform chunks without the head: the walk's peak is the simulator's in-flight count of chunks
    times one chunk's bytes (a different code path: the simulator times the schedule)."""
    cfg = pipeline_cfg(pp, vpp, schedule, micro)
    split = layer_split(cfg)
    in_flight = simulate(build_schedule(pp, vpp, micro, schedule)).peak_in_flight
    head = pp * vpp - 1
    for r in range(pp):
        if head in chunks_of_rank(r, pp, vpp, schedule):
            continue
        chunk = chunk_activation_bytes(cfg, r, split[chunks_of_rank(r, pp, vpp, schedule)[0]], False)
        assert schedule_activation_bytes(cfg, r, split) == in_flight[r] * chunk
        if schedule == "1f1b":  # Narayanan et al. 2021: stage r holds min(m, pp - r) micro-batches
            assert in_flight[r] == min(micro, pp - r)
        if schedule == "gpipe":
            assert in_flight[r] == micro


@pytest.mark.parametrize(
    "schedule,vpp",
    [("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("interleaved", 4), ("zbv", 2), ("dualpipev", 2)],
)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_walk_sees_every_peak_within_its_micro_batch_cap(schedule, vpp, pp):
    """The planner walks at most 4·pp·vpp micro-batches (walked_micro_batches: a step of thousands would
    cost minutes): with chunks of unequal sizes, every rank's peak over 3 times as many is the same."""
    cap = walked_micro_batches(10**6, pp, vpp, schedule)
    assert cap == 4 * pp * vpp and walked_micro_batches(10**6, pp, vpp, "gpipe") == 10**6
    kept = {c: 1000.0 + 37 * c * c for c in range(pp * vpp)}
    split = schedule in SPLIT_BACKWARD  # a W pass frees what B left waiting
    waiting = {c: (300.0 + 11 * c if c and split else 0.0) for c in range(pp * vpp)}
    capped, full = compute_orders(pp, vpp, cap, schedule), compute_orders(pp, vpp, 3 * cap, schedule)
    for rank in range(pp):
        assert peak_of(alive_counts(full[rank]), kept, waiting) == peak_of(
            alive_counts(capped[rank]), kept, waiting
        )


def test_zero_bubble_first_stage_waits_for_nothing_and_later_stages_keep_weight_inputs():
    """Chunk 0's B computes its weight gradients at once (nothing needs its input gradient), so stage 0
    holds what 1F1B holds; a later stage also keeps, between B and W, its linear layers' inputs and
    output gradients: more than 1F1B, less than keeping whole chunks to W."""
    zb, one = pipeline_cfg(4, 1, "zero_bubble", 8), pipeline_cfg(4, 1, "1f1b", 8)
    split = layer_split(zb)
    assert schedule_activation_bytes(zb, 0, split) == schedule_activation_bytes(one, 0, split)
    waiting = waiting_weight_grad_bytes(zb, split[2], False)
    kept = chunk_activation_bytes(zb, 2, split[2], False)
    assert 0 < waiting < kept
    zb2, one2 = schedule_activation_bytes(zb, 2, split), schedule_activation_bytes(one, 2, split)
    assert zb2 == one2 + 2 * waiting  # ZB-H1: stage r keeps r micro-batches' weight inputs beyond 1F1B's


def test_optimizer_temporary_counts_only_where_it_exceeds_the_activations():
    """foreach AdamW's temporary (half the optimizer state) comes after backward freed the activations:
    under full recompute (few activations) it sets the peak, without recompute it does not."""
    for recompute, micro, sets_peak in (("full", 1, True), ("none", 8, False)):
        cfg = resolved(
            load_config(
                None, [*TINY, f"--training.micro_batch={micro}", f"--training.recompute={recompute}"]
            ),
            1,
        )
        stage = stage_memory(cfg, 1, 0, None, NONE)
        temporary = optimizer_transient_bytes(stage["optimizer"])
        assert temporary == stage["optimizer"] / 2
        peak = stage["activations"] + stage["transient"]
        assert (peak == temporary) is sets_peak
        assert peak >= temporary


def _walked_peak(steps, kept, waiting):
    """The peak walked step by step, the plain way (what alive_counts and peak_of reduce)."""
    alive = peak = 0.0
    split = any(kind == Kind.W for kind, _, _ in steps)
    for kind, chunk, _ in steps:
        alive += {Kind.F: kept[chunk], Kind.B: (waiting[chunk] if split else 0.0) - kept[chunk]}.get(
            kind, 0.0
        )
        alive -= waiting[chunk] if kind == Kind.W else 0.0
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize(
    "schedule,vpp",
    [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 3), ("zbv", 2), ("dualpipev", 2)],
)
def test_the_reduced_walk_finds_the_plain_walks_peak(schedule, vpp):
    """alive_counts keeps only the states no other state holds as much of every chunk as: with chunks of
    unequal sizes, and weight-gradient inputs larger than the activations, the peak is the plain walk's."""
    pp, micro = 4, 12
    for seed in range(3):
        kept = {c: 100.0 + 37 * ((c + seed) % 5) for c in range(pp * vpp)}
        waiting = {c: 50.0 + 90 * ((c * 3 + seed) % 4) for c in range(pp * vpp)}
        for steps in compute_orders(pp, vpp, micro, schedule):
            assert peak_of(alive_counts(steps), kept, waiting) == _walked_peak(steps, kept, waiting)
