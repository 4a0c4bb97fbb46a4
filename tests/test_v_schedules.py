"""V-shaped schedules as pure data (schedules/v_shape.py): placement, completeness, the simulator's
checks (matching, order, deadlock) over a grid of pp and micro-batch counts, and bubbles and peak
activations against the published figures (docs/pipeline.md#v-shaped-schedules)."""

from __future__ import annotations

import random

import pytest

from meshtron.commands.main import main
from meshtron.schedules.actions import chunks_of_rank, rank_of_chunk
from meshtron.schedules.build import build_schedule, send_release_points, simulate

V = ("zbv", "dualpipev")


def least(name: str, pp: int) -> int:
    return 2 * pp if name == "dualpipev" else 1


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_v_placement_puts_both_ends_on_rank_zero(pp):
    for name in V:
        assert chunks_of_rank(0, pp, 2, name) == [0, 2 * pp - 1]
        assert chunks_of_rank(pp - 1, pp, 2, name) == [pp - 1, pp]  # the V's turn stays on one rank
        for rank in range(pp):
            assert [rank_of_chunk(c, pp, name) for c in chunks_of_rank(rank, pp, 2, name)] == [rank, rank]


@pytest.mark.parametrize("name", V)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_micro_batch_runs_once_per_chunk_and_the_simulator_accepts_it(name, pp):
    for m in range(least(name, pp), 4 * pp + 2):
        schedule = build_schedule(pp, 2, m, name)
        simulate(schedule, 1.0, 2.0, 1.0, vpp=2)  # raises on unmatched messages, bad order, deadlock
        for rank, actions in enumerate(schedule):
            chunks = chunks_of_rank(rank, pp, 2, name)
            for kind in ("F", "B", "W"):
                done = sorted((a.chunk, a.mb) for a in actions if a.kind == kind)
                assert done == sorted((c, mb) for c in chunks for mb in range(m)), (m, rank, kind)


def idle_per_rank(name: str, pp: int, m: int, f: float, b: float, w: float) -> tuple[float, list[int]]:
    """Per-rank idle time of one step with per-chunk costs F, B (input gradient), W, and the peak chunk
    activations in flight per rank."""
    sim = simulate(build_schedule(pp, 2, m, name), 2 * f, 2 * (b + w), 2 * w, vpp=2)
    return sim.makespan - m * 2 * (f + b + w), sim.peak_in_flight


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbv_bubble_is_the_forward_ramp_at_one_f_one_b_memory(pp):
    """Qi et al.'s ZB-V with F = B = W: within a step only the ramp is left, (pp−1)·F per rank (the paper
    also overlaps it with the next step's by post-validating the optimizer step; meshtron's step is
    synchronous): half of ZB-H1's (pp−1)·(F+B−W) and a sixth of 1F1B's at the same stage costs, while
    each rank keeps at most 2·pp chunk activations, 1F1B's pp stages."""
    for m in (2 * pp, 3 * pp + 1, 4 * pp):
        idle, peak = idle_per_rank("zbv", pp, m, 1.0, 1.0, 1.0)
        assert idle == pytest.approx(pp - 1)
        assert peak == [2 * pp] * pp
        h1 = simulate(build_schedule(pp, 1, m, "zero_bubble"), 2.0, 4.0, 2.0)  # a stage is two chunks
        assert h1.makespan - 6 * m == pytest.approx(2 * idle)
        one_f_one_b = simulate(build_schedule(pp, 1, m, "1f1b"), 2.0, 4.0)
        assert one_f_one_b.makespan - 6 * m == pytest.approx(6 * idle)
        assert max(one_f_one_b.peak_in_flight) * 2 == max(peak)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_dualpipev_keeps_pp_plus_one_activations(pp):
    """DeepSeek-V3's table: DualPipe keeps PP + 1 micro-batches' activations over its PP stages; cut in
    half onto pp ranks of 2·pp chunks that is 2·pp + 1 chunk activations, one more than ZB-V, and the
    same ramp-only bubble at F = B = W."""
    for m in (2 * pp, 4 * pp):
        idle, peak = idle_per_rank("dualpipev", pp, m, 1.0, 1.0, 1.0)
        assert peak == [2 * pp + 1] * pp
        assert idle == pytest.approx(pp - 1)


def test_dualpipev_bubble_stays_within_deepseeks_figure_at_any_costs():
    """DeepSeek-V3's table gives DualPipe's bubble as (PP/2 − 1)·(F&B + B − 3W) over PP ranks (B a full
    backward, F&B an overlapped forward + backward pair); on a V of pp ranks that is (pp − 1)·(...) per
    chunk. The simulator overlaps nothing, so F&B = F + B there. Over random chunk costs, meshtron's
    dualpipev idles per rank at most that figure (0 where it goes negative) plus the forward ramp
    (pp − 1)·F that a synchronous optimizer step keeps (see the ZB-V test above). Where F&B + B = 3W
    the published bubble is zero, and only the ramp is left."""
    rng = random.Random(0)
    gaps = []
    for _ in range(200):
        pp = rng.choice([2, 3, 4, 8])
        m = rng.choice([2 * pp, 3 * pp, 4 * pp])
        f, b, w = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.5), rng.uniform(0.2, 2.0)
        idle, _ = idle_per_rank("dualpipev", pp, m, f, b, w)
        full = b + w
        published = max(0.0, (pp - 1) * ((f + full) + full - 3 * w))
        gaps.append((pp - 1) * f + published - idle)
    assert min(gaps) >= -1e-9
    for pp in (2, 4, 8):  # F = 1, B = 0.5 + 2, W = 2: F&B + B − 3W = 3.5 + 2.5 − 6 = 0
        assert idle_per_rank("dualpipev", pp, 4 * pp, 1.0, 0.5, 2.0)[0] == pytest.approx(pp - 1)


def test_v_schedule_rules_are_named():
    with pytest.raises(ValueError, match="set parallel.vpp=2"):
        build_schedule(4, 1, 8, "zbv")
    with pytest.raises(ValueError, match="at least 2\\*pp=8 micro-batches"):
        build_schedule(4, 2, 6, "dualpipev")


@pytest.mark.parametrize("name", V)
def test_sent_activations_are_settled_before_their_gradient_returns(name):
    """Every activation sent to another rank is proved received by a later message, before its gradient
    comes back except for the first micro-batch (its gradient is the first message back); the hand-off
    at the V's turn stays on its rank and needs no proof."""
    pp, m = 4, 8
    schedule = build_schedule(pp, 2, m, name)
    for rank in range(pp):
        actions = schedule[rank]
        settled = {key: i for i, keys in send_release_points(schedule, rank).items() for key in keys}
        remote = [(a.chunk, a.mb) for a in actions if a.kind == "SEND_F" and a.peer != rank]
        assert sorted(settled) == sorted(remote)
        back = {(a.chunk, a.mb): i for i, a in enumerate(actions) if a.kind == "RECV_B"}
        assert all(settled[key] <= back[key] for key in remote if key[1] > 0)


def test_schedule_command_draws_a_v(tmp_path, capsys):
    out = tmp_path / "zbv.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zbv", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "zbv: pp=4 vpp=2" in printed and "bubble 5.9%" in printed and "rank 0: F0.0" in printed
    assert out.read_bytes()[:4] == b"\x89PNG"
