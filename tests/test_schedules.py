"""Pipeline schedules are pure data: their simulated bubbles match the published formulas
(docs/theory.md#pipeline-bubbles), they never deadlock, every backward follows its forward, every send
has its receive, and memory stays bounded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshtron.schedules.actions import Action
from meshtron.schedules.build import build_schedule, send_release_points, simulate

GRID = [(pp, m) for pp in (2, 3, 4, 8) for m in (pp, 2 * pp, 4 * pp, 3 * pp + 1)]


@pytest.mark.parametrize("pp, m", GRID)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    for name in ("gpipe", "1f1b"):
        sim = simulate(build_schedule(pp, 1, m, name), cost_f=1.0, cost_b=2.0)
        assert sim.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12), name
        assert sim.makespan == pytest.approx(3 * (m + pp - 1))


@pytest.mark.parametrize("pp, m", GRID)
def test_1f1b_keeps_at_most_pp_micro_batches_in_flight(pp, m):
    sim = simulate(build_schedule(pp, 1, m, "1f1b"))
    assert sim.peak_in_flight == [min(pp - r, m) for r in range(pp)]
    assert simulate(build_schedule(pp, 1, m, "gpipe")).peak_in_flight == [m] * pp


@pytest.mark.parametrize(
    "pp, vpp, m", [(pp, v, k * pp) for pp in (2, 4) for v in (2, 3, 4) for k in (1, 2, 3)]
)
def test_interleaved_bubble_shrinks_by_vpp(pp, vpp, m):
    sim = simulate(build_schedule(pp, vpp, m, "interleaved"), cost_f=1.0, cost_b=2.0, vpp=vpp)
    # Narayanan et al. 2021: (p-1)/(v·m) relative to ideal compute, i.e. this fraction of ranks x time.
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-12)
    # First rank's activations (in stage units: a chunk holds 1/vpp of a stage) grow by 1 + (p-1)/(p·v).
    if m >= pp * vpp:
        assert sim.peak_in_flight[0] / vpp == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_h1_has_a_third_of_1f1b_bubble_at_the_same_memory(pp, m):
    zb = simulate(build_schedule(pp, 1, m, "zero_bubble"), cost_f=1.0, cost_b=2.0, cost_w=1.0)
    one_f_one_b = simulate(build_schedule(pp, 1, m, "1f1b"), cost_f=1.0, cost_b=2.0)
    idle = zb.makespan - 3 * m  # per rank, with F = B = W = 1
    assert idle == pytest.approx((pp - 1) * (1 + 1 - 1))  # Qi et al.: (p-1)(F + B - W)
    assert idle == pytest.approx((one_f_one_b.makespan - 3 * m) / 3)
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb.peak_in_flight == one_f_one_b.peak_in_flight
    # Qi et al.'s ZB-H1 memory: rank r delays W by r, so it holds at most pp - r micro-batches between
    # F and B and r more waiting for W (their linear inputs only; r + 1 from a B to the W after it):
    # pp between F and W, as 1F1B's rank 0.
    for rank, actions in enumerate(build_schedule(pp, 1, m, "zero_bubble")):
        count = {
            kind: [sum(a.kind == kind for a in actions[:i]) for i in range(len(actions) + 1)]
            for kind in "FBW"
        }
        between_f_and_b = [f - b for f, b in zip(count["F"], count["B"], strict=True)]
        waiting = [b - w for b, w in zip(count["B"], count["W"], strict=True)]
        assert max(between_f_and_b) == min(pp - rank, m) and max(waiting) == min(rank + 1, m)
        assert max(f - w for f, w in zip(count["F"], count["W"], strict=True)) == min(pp, m)


@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("costs", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.6), (1.0, 3.0, 1.8), (1.0, 1.5, 0.5)])
def test_zero_bubble_h1_idles_no_more_than_1f1b_less_its_weight_passes(pp, costs):
    """Any F, B, W costs and micro-batch counts (fewer than pp too): the drain's Ws fill what 1F1B leaves
    idle, so each rank idles at most (pp - 1)·(F + B - W), 1F1B's (pp - 1)·(F + B) less its Ws."""
    cost_f, cost_b, cost_w = costs
    for m in (1, pp - 1, pp, pp + 1, 2 * pp + 3, 5 * pp):
        if m < 1:
            continue
        zb = simulate(build_schedule(pp, 1, m, "zero_bubble"), cost_f=cost_f, cost_b=cost_b, cost_w=cost_w)
        idle = zb.makespan - m * (cost_f + cost_b)
        assert idle <= (pp - 1) * (cost_f + cost_b - cost_w) + 1e-9, (m, idle)


@pytest.mark.parametrize("name, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_every_micro_batch_runs_once_per_chunk(name, vpp):
    pp, m = 4, 8
    schedule = build_schedule(pp, vpp, m, name)
    for rank, actions in enumerate(schedule):
        chunks = {rank + v * pp for v in range(vpp)}
        for kind in ("F", "B") + (("W",) if name == "zero_bubble" else ()):
            done = sorted((a.chunk, a.mb) for a in actions if a.kind == kind)
            assert done == sorted((c, mb) for c in chunks for mb in range(m)), (rank, kind)


def test_simulator_rejects_broken_schedules():
    good = build_schedule(2, 1, 2, "1f1b")
    swapped = [list(good[0]), good[1]]
    f_index = next(i for i, a in enumerate(swapped[0]) if a.kind == "F")
    b_index = next(i for i, a in enumerate(swapped[0]) if a.kind == "B")
    swapped[0][f_index], swapped[0][b_index] = swapped[0][b_index], swapped[0][f_index]
    with pytest.raises(ValueError, match="before the forward|deadlock"):
        simulate(swapped)
    missing_recv = [good[0], [a for a in good[1] if a.kind != "RECV_F"]]
    with pytest.raises(ValueError, match="unmatched sends/receives"):
        simulate(missing_recv)
    # Both ranks first wait for the other's gradient: a deadlock, named.
    deadlock = [
        [Action("RECV_B", 0, 0, 1), Action("F", 0, 0), Action("SEND_F", 0, 0, 1), Action("B", 0, 0)],
        [Action("SEND_B", 1, 0, 0), Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
    ]
    deadlock[1] = [Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0, 0)]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(deadlock)


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="multiple of pp=4"):
        build_schedule(4, 2, 6, "interleaved")
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule(4, 1, 4, "2f2b")
    with pytest.raises(ValueError, match="needs the interleaved schedule"):
        build_schedule(4, 2, 8, "1f1b")


def meshtron(command: str, *more: str) -> subprocess.CompletedProcess:
    """`meshtron COMMAND MORE...` in a fresh process."""
    argv = [sys.executable, "-m", "meshtron", *command.split(), *more]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_schedule_command(tmp_path):
    out = meshtron("schedule --pp 4 --microbatches 8 --schedule zero_bubble --out", str(tmp_path / "zb.png"))
    assert out.returncode == 0, out.stderr
    assert "bubble 11.1%" in out.stdout and "peak micro-batches in flight per rank: 4, 3, 2, 1" in out.stdout
    assert (tmp_path / "zb.png").read_bytes()[:4] == b"\x89PNG"
    bad = meshtron("schedule --pp 4 --vpp 2 --microbatches 6 --schedule interleaved")
    assert bad.returncode == 2 and "multiple of pp=4" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name, pp, vpp", [("1f1b", 4, 1), ("interleaved", 4, 2), ("zero_bubble", 4, 1)])
def test_sent_activations_are_settled_by_a_later_receive(name, pp, vpp):
    """Every activation a rank sends is proved received by a message the peer sent afterwards, before the
    rank needs the activation's backward; on the first rank all but the first micro-batch are settled
    before their own gradient comes back (so the output is freed during the wait, not after it)."""
    schedule = build_schedule(pp, vpp, 8, name)
    for rank in range(pp - 1):
        actions = schedule[rank]
        settled = {key: i for i, keys in send_release_points(schedule, rank).items() for key in keys}
        sent = [(a.chunk, a.mb) for a in actions if a.kind == "SEND_F"]
        assert sorted(settled) == sorted(sent)
        grad_back = {(a.chunk, a.mb): i for i, a in enumerate(actions) if a.kind == "RECV_B"}
        assert all(settled[key] <= grad_back[key] for key in sent)
        if rank == 0:
            early = sum(settled[key] < grad_back[key] for key in sent)
            assert early == len(sent) - 1


@pytest.mark.parametrize("name, vpp", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_measured_timeline_is_simulated_from_its_own_action_times(tmp_path, name, vpp):
    """A timeline with unequal stages (the last chunk twice as slow) and free communication: simulated
    from its own per-chunk action times, it comes out the same, bubble and all."""
    from meshtron.pictures.pipeline import draw_measured_timeline

    pp, m = 3, 6
    slow = {
        (kind, c): (2.0 if c == pp * vpp - 1 else 1.0) * base
        for kind, base in (("F", 1.0), ("B", 1.5), ("W", 0.5))
        for c in range(pp * vpp)
    }
    truth = simulate(build_schedule(pp, vpp, m, name), vpp=vpp, chunk_costs=slow)
    as_seconds = [[(a, start / 1e3, end / 1e3) for a, start, end in rank] for rank in truth.timeline]
    path, measured, simulated = draw_measured_timeline(as_seconds, name, vpp, m, tmp_path / "t.png")
    assert path.exists()
    assert measured == pytest.approx(truth.bubble_fraction, abs=1e-12)
    assert simulated == pytest.approx(truth.bubble_fraction, abs=1e-12)
    uniform = simulate(build_schedule(pp, vpp, m, name), vpp=vpp)
    assert truth.bubble_fraction > uniform.bubble_fraction  # the slow last stage makes the others wait


@pytest.mark.parametrize(
    "pp, m, name, vpp", [(2, 2, "1f1b", 1), (4, 4, "interleaved", 2), (8, 16, "1f1b", 1)]
)
def test_timeline_pictures_keep_titles_and_blocks_inside(monkeypatch, tmp_path, pp, m, name, vpp):
    """The measured picture's second title was cut at a narrow figure's edges, and rank 0's last block
    (or a wait after it) ended on or past the frame: every title lies inside the figure, every bar and
    wait inside the time axis."""
    from meshtron.pictures import pipeline as picture

    figures = []
    monkeypatch.setattr(picture, "save_figure", lambda fig, out: figures.append(fig) or fig.tight_layout())
    sim = simulate(build_schedule(pp, vpp, m, name), vpp=vpp)
    as_seconds = [[(a, start / 1e3, end / 1e3) for a, start, end in rank] for rank in sim.timeline]
    last = [rank[-1][2] / 1e3 for rank in sim.timeline]
    waits = [[("send", "pp", "main", end, end + 0.5e-3)] for end in last]  # past the last action
    picture.draw_measured_timeline(as_seconds, name, vpp, m, tmp_path / "t.png", waits)
    picture.draw_timeline(sim.timeline, tmp_path / "s.png", "a title " * 12, vpp)
    for fig, latest in zip(
        figures, (1e3 * max(last) + 0.5, max(r[-1][2] for r in sim.timeline)), strict=True
    ):
        fig.canvas.draw()
        frame = fig.bbox
        for ax in fig.axes:
            box = ax.title.get_window_extent()
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1, ax.get_title()
            assert ax.get_xlim()[1] > latest
