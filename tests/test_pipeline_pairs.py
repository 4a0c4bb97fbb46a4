"""DualPipeV's F&B pairs run at once (pipeline/pairs.py): the schedule's pairs, their cost when nothing
overlaps, the config rules, parity with one device, and the measured timeline showing one micro-batch's
expert all-to-alls running while the other micro-batch computes."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.record import recorder
from meshtron.commands.main import main
from meshtron.pipeline.pairs import hidden_exchanges, run_pair
from meshtron.rules.checks import load_config, validate
from meshtron.rules.pipeline import UNVERIFIED_PAIR_LANE
from meshtron.schedules.actions import Action, Kind
from meshtron.schedules.build import build_schedule, simulate
from meshtron.testing.parity import assert_parity, merged, reference, run_layout, trainer_for
from meshtron.testing.tiny import MOE, TINY

MOE_4 = [*MOE, "--model.n_layers=4"]
PAIRED = [
    "--parallel.pp=2",
    "--parallel.pp_schedule=dualpipev",
    "--parallel.vpp=2",
    "--parallel.dp_shard=2",
    "--parallel.ep=2",
    "--parallel.zero=1",
    "--training.micro_batch=1",
    "--parallel.pp_overlap=true",
]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_pairs_are_units_with_both_inputs_received_first(pp):
    """Every pair is an F and the full backward (B, W) of another chunk and micro-batch; both of its
    receives come before the F and its backward's send after the W, and the lists still cannot deadlock."""
    for m in range(2 * pp, 3 * pp + 2):
        schedule = build_schedule(pp, 2, m, "dualpipev", paired=True)
        simulate(schedule)  # raises on a deadlock, an unmatched message or a backward before its forward
        for actions in schedule:
            computes = [(i, a) for i, a in enumerate(actions) if a.kind.is_compute]
            pairs = [k for k, (_, a) in enumerate(computes) if a.paired]
            assert pairs, "the steady phase pairs every rank's forwards with backwards"
            for k in pairs:
                (i, f), (j, b), (_, w) = computes[k : k + 3]
                assert (f.kind, b.kind, w.kind) == (Kind.F, Kind.B, Kind.W)
                assert f.chunk != b.chunk and (w.chunk, w.mb) == (b.chunk, b.mb)
                received = {(a.kind, a.chunk, a.mb) for a in actions[:i] if a.kind.is_recv}
                if f.chunk > 0:
                    assert (Kind.RECV_F, f.chunk, f.mb) in received
                if b.chunk < 2 * pp - 1:
                    assert (Kind.RECV_B, b.chunk, b.mb) in received
                assert all(not a.kind.is_recv for a in actions[i:j])


def test_pairing_without_overlap_costs_about_one_ramp_of_forwards():
    """With nothing overlapped (F&B = F + B), waiting for both of a pair's inputs costs once per step
    what the ramp costs: exactly (pp − 1) chunk forwards at F = B = W, whatever the micro-batches, and
    between nothing and (pp − 1)·(F + B) at other costs; activations are unchanged. A pair pays off when
    the communication it hides over the step exceeds that."""
    for pp in (2, 3, 4, 8):
        for m in (2 * pp, 3 * pp + 1, 4 * pp):
            one_by_one = simulate(build_schedule(pp, 2, m, "dualpipev"), 1.0, 2.0, 1.0)
            paired = simulate(build_schedule(pp, 2, m, "dualpipev", paired=True), 1.0, 2.0, 1.0)
            assert paired.makespan - one_by_one.makespan == pytest.approx(pp - 1)
            assert paired.peak_in_flight == one_by_one.peak_in_flight
    rng = random.Random(0)
    for _ in range(60):
        pp = rng.choice([2, 3, 4, 8])
        m = rng.choice([2 * pp, 3 * pp, 4 * pp])
        f, b, w = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.5), rng.uniform(0.2, 2.0)
        one_by_one = simulate(build_schedule(pp, 2, m, "dualpipev"), f, b + w, w, vpp=2)
        paired = simulate(build_schedule(pp, 2, m, "dualpipev", paired=True), f, b + w, w, vpp=2)
        assert 0 <= paired.makespan - one_by_one.makespan <= (pp - 1) * (f + b) / 2 + 1e-9


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (["--parallel.pp_schedule=zbv"], 2, "needs parallel.pp > 1 with parallel.pp_schedule='dualpipev'"),
        (["--parallel.dp_shard=2", "--parallel.zero=3"], 4, "cannot be combined with ZeRO-3"),
        (["--training.compile=true"], 2, "cannot be combined with training.compile"),
        (["--run.device=cuda"], 2, "not verified on two or more GPUs yet"),
    ],
)
def test_overlap_rules_are_named(extra, world, message, monkeypatch):
    monkeypatch.delenv(UNVERIFIED_PAIR_LANE, raising=False)
    assert any(message in problem for problem in overlap_problems(extra, world))


def overlap_problems(extra: list[str], world: int) -> list[str]:
    base = [
        "--parallel.pp=2",
        "--parallel.pp_schedule=dualpipev",
        "--parallel.vpp=2",
        "--parallel.dp_shard=1",
    ]
    return validate(load_config(None, [*TINY, *MOE_4, *base, "--parallel.pp_overlap=true", *extra]), world)


def test_the_unverified_cuda_pair_lane_runs_only_when_asked(monkeypatch):
    monkeypatch.setenv(UNVERIFIED_PAIR_LANE, "1")
    assert not any("pp_overlap" in problem for problem in overlap_problems(["--run.device=cuda"], 2))
    monkeypatch.setenv(UNVERIFIED_PAIR_LANE, "0")
    assert any("not verified" in problem for problem in overlap_problems(["--run.device=cuda"], 2))


def test_a_cpu_pair_runs_without_streams():
    """run_pair on the CPU (no side stream): the forward runs in another thread, both finish, and an error
    in either reaches the caller."""
    threads = []
    run_pair(
        Comm(), lambda: threads.append(threading.current_thread().name), lambda: None, torch.device("cpu")
    )
    assert threads == ["meshtron-pair-forward"]
    with pytest.raises(ValueError, match="in the forward"):
        run_pair(Comm(), lambda: (_ for _ in ()).throw(ValueError("in the forward")), lambda: None)


def test_hidden_exchanges_counts_only_the_other_threads_compute():
    f, b, w = Action(Kind.F, 0, 3, paired=True), Action(Kind.B, 3, 1), Action(Kind.W, 3, 1)
    timeline = [(f, 0.0, 10.0), (b, 0.0, 6.0), (w, 6.0, 9.0), (Action(Kind.F, 0, 4), 11.0, 12.0)]
    waits = [
        ("all_to_all", "ep", "pair", 2.0, 4.0),  # the backward computes in [2, 3], waits itself in [3, 4]
        ("all_to_all", "ep", "pair", 7.0, 8.0),  # the W computes throughout
        ("all_to_all", "ep", "main", 3.0, 5.0),
        ("all_to_all", "ep", "main", 11.2, 11.5),  # an unpaired forward's: not a pair's
    ]
    assert hidden_exchanges(timeline, waits) == (3.0, 3.0, 2.0)


def pairs_and_waits(overrides: list[str]) -> dict:
    """Parity results, whether the runtime overlapped, and the last step's compute and comm timelines."""
    result = run_layout(overrides)
    trainer = trainer_for(overrides)
    trainer.step(0)
    runtime = trainer.parallel.pipeline
    return {
        **result,
        "overlap": runtime.overlap,
        "timeline": runtime.timeline,
        "waits": runtime.comm_timeline,
    }


def test_paired_all_to_alls_run_while_the_other_micro_batch_computes(workers):
    """MoE with ep=2 in each stage of a dualpipev pp=2 (ZeRO-1 over the two dp ranks): the pairs' forwards
    run in a second thread on the twin groups; 6 steps match one device. In the last step, on every rank,
    the all-to-alls of paired forwards (the pair lane's) overlap the backward of the other micro-batch
    while it computes (its spans less its own communication waits)."""
    results = workers(4).run(pairs_and_waits, [*TINY, *MOE_4, *PAIRED, "--training.recompute=full"])
    assert all(r["overlap"] for r in results)
    assert_parity(merged([results[0], results[2]]), reference(workers(1), MOE_4, micro_batch=1))
    for r in results:
        waited, inside_forwards, while_computing = hidden_exchanges(r["timeline"], r["waits"])
        assert waited > 0 and inside_forwards == pytest.approx(waited)
        assert while_computing > 0


OVERLAPPED_V = [
    "--parallel.pp=2",
    "--parallel.pp_schedule=dualpipev",
    "--parallel.vpp=2",
    "--parallel.pp_overlap=true",
    "--training.micro_batch=1",
    "--model.n_layers=8",
]
COMPOSED = {
    "pp_only": (2, ["--parallel.dp_shard=1"]),
    "tp2_sp": (4, ["--parallel.dp_shard=1", "--parallel.tp=2", "--parallel.sp=true"]),
    "ring_cp2_zero1": (4, ["--parallel.dp_shard=1", "--parallel.cp=2", "--parallel.zero=1"]),
    "zero2": (4, ["--parallel.dp_shard=2", "--parallel.zero=2"]),
    # MoE folded: the experts' ep 2 laid over the stage's tp ranks (etp 1), the pairs' all-to-alls on twins
    "moe_ep2_over_tp2": (
        4,
        [*MOE, "--parallel.dp_shard=1", "--parallel.tp=2", "--parallel.ep=2", "--parallel.etp=1"],
    ),
    # the hierarchical dispatch with each rank its own node: its network hop on the pair lane's twin
    "moe_ep2_hierarchical": (
        4,
        [
            *MOE,
            "--parallel.dp_shard=2",
            "--parallel.zero=1",
            "--parallel.ep=2",
            "--parallel.ep_dispatch=hierarchical",
            "--run.gpus_per_node=1",
        ],
    ),
}


@pytest.mark.parametrize("composed", list(COMPOSED))
def test_overlapped_pairs_compose(workers, composed):
    """A dense model's pairs overlapped alone (no group but pp's: nothing to twin), under tensor +
    sequence parallel, ring context parallel (its point-to-point exchanges on the twin cp group),
    ZeRO-2 (gradients reduce-scattered every micro-batch from the backward's thread), an MoE whose
    experts are folded over the tp ranks (ep 2, etp 1) and one whose tokens take the hierarchical
    dispatch's two hops: 6 steps match one device."""
    world, layout = COMPOSED[composed]
    results = workers(world).run(run_layout, [*TINY, *OVERLAPPED_V, *layout])
    stages = [results[0], results[world // 2]]
    model = [o for o in layout if o.startswith("--model.")]  # MoE: the balance loss is per micro-batch
    assert_parity(merged(stages), reference(workers(1), [*model, "--model.n_layers=8"], micro_batch=1))


def test_pair_lane_collectives_are_numbered_apart_for_the_flight_recorder():
    """A hang report compares how many collectives each rank issued on a group; the pair lane's go to
    twin groups at their own pace, so they are numbered under "<group>~pair"."""
    flight, comm = recorder(), Comm()
    before = dict(flight.issued)
    with comm.pair_lane():
        assert comm.lane() == "pair"
        comm.stats.record("ep", "all_to_all", 8.0)
    comm.stats.record("ep", "all_to_all", 8.0)
    assert comm.lane() == "main"
    assert flight.issued["ep~pair"] == before.get("ep~pair", 0) + 1
    assert flight.issued["ep"] == before.get("ep", 0) + 1


def test_schedule_command_shows_the_pairs(tmp_path, capsys):
    out = tmp_path / "pairs.png"
    args = [
        "schedule",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--schedule",
        "dualpipev",
        "--paired",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "rank 1: F1.0 F2.0 F1.1 F2.1 F1.2& B2.0 W2.0" in printed and "bubble 7.7%" in printed
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zbv", "--paired"]) == 2
    assert "--paired is DualPipeV's" in capsys.readouterr().err
