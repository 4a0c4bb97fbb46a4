"""parallel.pp_balance = "cost": the layer split minimising the largest chunk's predicted training FLOPs
(schedules/balance.py), exact against brute force, better than even counts where the head or MoE layers
weigh, refused with explicit splits, and a run on it equal to the single-device run."""

from __future__ import annotations

import itertools
import random

import pytest

from meshtron.plan.flops import layer_costs
from meshtron.plan.state import layer_split
from meshtron.rules.checks import load_config, validate
from meshtron.schedules.actions import Kind, rank_of_chunk
from meshtron.schedules.build import build_schedule, simulate
from meshtron.schedules.split import split_by_cost, split_by_cost_v
from meshtron.testing.parity import assert_parity, merged, reference, run_layout
from meshtron.testing.tiny import MOE, TINY

WIDE_VOCAB = ["--model.n_layers=8", "--model.vocab_size=2048"]  # a head worth ~2.7 layers


def brute_force(costs: list[float], chunks: int, first: float, last: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), chunks - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def largest(costs: list[float], counts: list[int], first: float, last: float) -> float:
    bounds = list(itertools.accumulate([0, *counts]))
    loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_split_by_cost_is_the_exact_optimum():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        chunks = rng.randint(1, n)
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 4)
        counts = split_by_cost(costs, chunks, first, last)
        assert len(counts) == chunks and min(counts) >= 1 and sum(counts) == n
        assert largest(costs, counts, first, last) == pytest.approx(brute_force(costs, chunks, first, last))


def chunk_costs(cfg, split) -> dict:
    layers, embedding, head = layer_costs(cfg.model, cfg.training.seq_len)
    out = {}
    for c, chunk in enumerate(split):
        cost = (
            sum(layers[i] for i in chunk)
            + (embedding if c == 0 else 0)
            + (head if c == len(split) - 1 else 0)
        )
        for kind, share in ((Kind.F, 1), (Kind.B, 1), (Kind.W, 1)):
            out[kind, c] = share * cost / 3
    return out


@pytest.mark.parametrize(
    "model, layout",
    [
        (WIDE_VOCAB, ["--parallel.pp=2"]),
        (WIDE_VOCAB, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=zbv"]),
        ([*MOE, "--model.n_layers=8", "--model.dense_layers=[0, 1, 2]"], ["--parallel.pp=4"]),
    ],
    ids=["head", "zbv", "moe_after_dense"],
)
def test_cost_split_beats_even_counts_in_the_simulator(model, layout):
    """The largest chunk is cheaper than under even counts, and the simulated step with each chunk's
    predicted costs is shorter (the bubble before and after)."""
    base = load_config(None, [*TINY, *model, *layout, "--training.micro_batch=1"])
    cost = load_config(
        None, [*TINY, *model, *layout, "--training.micro_batch=1", "--parallel.pp_balance=cost"]
    )
    p = base.parallel
    name, vpp = p.pp_schedule, p.vpp
    even, balanced = layer_split(base), layer_split(cost)
    assert [len(c) for c in balanced] != [len(c) for c in even]
    sims = [
        simulate(build_schedule(p.pp, vpp, 8, name), chunk_costs=chunk_costs(base, split))
        for split in (even, balanced)
    ]
    assert busiest_rank(base, balanced) < busiest_rank(base, even)
    assert sims[1].makespan < sims[0].makespan


def busiest_rank(cfg, split) -> float:
    costs, p = chunk_costs(cfg, split), cfg.parallel
    loads = [0.0] * p.pp
    for (_kind, chunk), cost in costs.items():
        loads[rank_of_chunk(chunk, p.pp, p.pp_schedule)] += cost
    return max(loads)


def v_busiest_rank(costs: list[float], counts: list[int], pp: int, first: float, last: float) -> float:
    bounds = list(itertools.accumulate([0, *counts]))
    loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    loads[0] += first
    loads[-1] += last
    return max(loads[r] + loads[2 * pp - 1 - r] for r in range(pp))


def test_v_split_minimises_the_busiest_rank_exactly():
    """Under a V a rank runs chunks r and 2·pp−1−r: split_by_cost_v's busiest rank equals brute force's
    over every contiguous split into 2·pp chunks, and can beat the split with the cheapest largest chunk."""
    rng = random.Random(1)
    for _ in range(150):
        pp = rng.randint(1, 3)
        n = rng.randint(2 * pp, 2 * pp + 5)
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 4)
        counts = split_by_cost_v(costs, pp, first, last)
        assert len(counts) == 2 * pp and min(counts) >= 1 and sum(counts) == n
        best = min(
            v_busiest_rank(costs, [b - a for a, b in itertools.pairwise([0, *cuts, n])], pp, first, last)
            for cuts in itertools.combinations(range(1, n), 2 * pp - 1)
        )
        assert v_busiest_rank(costs, counts, pp, first, last) == pytest.approx(best, rel=1e-9)
    # Seven equal layers and a head worth three, pp 2: the cheapest largest chunk (2, 2, 2, 1 + head)
    # leaves rank 0 with 2 + 4 = 6; the V's own split (1, 2, 3, 1 + head) gives both ranks 5.
    costs, head = [1.0] * 7, 3.0
    assert split_by_cost(costs, 4, 0.0, head) == [2, 2, 2, 1]
    assert split_by_cost_v(costs, 2, 0.0, head) == [1, 2, 3, 1]
    assert v_busiest_rank(costs, [2, 2, 2, 1], 2, 0.0, head) == 6.0
    assert v_busiest_rank(costs, [1, 2, 3, 1], 2, 0.0, head) == 5.0


def test_cost_balance_refuses_an_explicit_split():
    overrides = [*TINY, "--parallel.pp=2", "--parallel.pp_balance=cost", "--parallel.pp_layers=[1, 1]"]
    assert any("pp_balance='cost'" in problem for problem in validate(load_config(None, overrides), 2))


def test_cost_balanced_pipeline_matches_single_device(workers):
    layout = [
        "--parallel.pp=2",
        "--parallel.pp_balance=cost",
        "--parallel.dp_shard=1",
        "--training.micro_batch=2",
    ]
    results = workers(2).run(run_layout, [*TINY, *WIDE_VOCAB, *layout])
    assert_parity(merged(results), reference(workers(1), WIDE_VOCAB))
