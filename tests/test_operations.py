"""Operating long runs: the phase clock, the straggler report, profiler traces and memory per phase,
asynchronous checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from meshtron.checkpoint.save_load import complete_checkpoints
from meshtron.comm.timing import SLOW_RANK, PhaseTimes
from meshtron.config.schema import ConfigError
from meshtron.observe.stragglers import straggler_line, straggler_report
from meshtron.observe.traces import ALIGN, memory_peaks, merge_traces
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import train_rows, trainer_for
from meshtron.testing.tiny import TINY


def ticking(times: PhaseTimes, ticks: list[float]) -> PhaseTimes:
    """`times` whose clock reads `ticks` in turn: exact accounting."""
    clock = iter(ticks)
    times.mark = lambda: next(clock)  # type: ignore[method-assign]
    return times


def test_phase_times_are_exclusive_and_waits_leave_compute():
    times = ticking(PhaseTimes(), [0.0, 1.0, 1.5, 3.0, 4.0, 4.5, 5.0, 7.0, 7.5, 8.0])
    with times.phase("backward"):  # 0 .. 7, a nested optimizer phase 1 .. 4 with a wait 1.5 .. 3
        with times.phase("optimizer"):
            times.waited("dp", times.mark(), times.mark())
        times.waited("tp", times.mark(), times.mark())  # 4.5 .. 5 inside backward
    with times.phase("forward"):
        pass
    taken = times.take()
    assert taken == {
        "compute": {"backward": 1.0 + 3.0 - 0.5, "optimizer": 3.0 - 1.5, "forward": 0.5},
        "waits": {"dp": 1.5, "tp": 0.5},
    }
    assert times.take() == {"compute": {}, "waits": {}}


def test_the_straggler_report_names_the_slowest_rank_and_phase():
    def rank(forward: float, backward: float, dp_wait: float) -> dict:
        return {
            "compute": {"forward": forward, "backward": backward, "optimizer": 0.2},
            "waits": {"dp": dp_wait},
        }

    times = [rank(1.0, 2.0, 3.0), rank(1.0, 2.4, 2.6), rank(3.0, 2.0, 0.2), rank(1.2, 2.0, 3.0)]
    report = straggler_report(times, steps=2)
    assert report["slowest_rank"] == 2
    assert report["slowest_compute_s"] == pytest.approx(5.2 / 2)
    assert report["median_compute_s"] == pytest.approx(3.4 / 2)  # the others: 3.2, 3.6, 3.4
    assert report["slowest_phase"] == "forward"
    assert report["slowest_phase_extra_s"] == pytest.approx((3.0 - 1.0) / 2)
    assert report["comm_wait_s_by_group"] == {"dp": pytest.approx(8.8 / 8)}
    line = straggler_line({"straggler_steps": [11, 12], **report}, threshold=0.1)
    assert line.startswith("meshtron: straggler in steps 11-12: rank 2 computed 2.600 s/step, 53% above")
    assert "most of it in forward (+1.000 s/step)" in line and "waited most on 'dp'" in line
    assert straggler_line({"straggler_steps": [1, 2], **report}, threshold=0.6) is None


def slowed_run(overrides: list[str]) -> list[dict]:
    os.environ[SLOW_RANK] = "1:0.15"
    try:
        return train_rows(overrides)
    finally:
        del os.environ[SLOW_RANK]


def test_a_rank_slowed_on_purpose_is_named(workers, tmp_path):
    """Rank 1 sleeps 0.15 s in every forward: every interval's report names it, in forward, and rank 0
    waits for it in the gradient reduction."""
    overrides = [*TINY, "--training.steps=4", "--training.micro_batch=4", "--run.log_every=2"]
    overrides += [f"--run.dir={tmp_path}", "--run.sample_tokens=0"]
    rows = workers(2).run(slowed_run, overrides)[0]
    reported = [r for r in rows if "slowest_rank" in r]
    assert [r["straggler_steps"] for r in reported] == [[1, 1], [2, 3], [4, 4]]
    for r in reported:
        assert r["slowest_rank"] == 1 and r["slowest_phase"] == "forward"
        # Past the report's 20% threshold; how far past depends on the rest of the step, which a busy
        # machine stretches (a loaded CI machine read 95% where an idle one reads over 100%).
        assert r["slowest_phase_extra_s"] > 0.1 and r["slowest_excess"] > 0.2
        assert max(r["comm_wait_s_by_group"].values()) > 0.05  # rank 0 waited for it


def traced_run(overrides: list[str]) -> dict:
    trainer = trainer_for(overrides)
    trainer.run()
    return {"rank": trainer.job.place.rank, "peaks": trainer.profiler.peaks_by_rank}


def test_profiled_steps_leave_named_traces_merged_over_ranks(workers, tmp_path):
    """Steps 2-3 of a 2-stage pipeline: a Chrome trace per rank with the phases, pipeline actions and
    collective waits named, one merged trace with a process per rank aligned on the barrier, and each
    rank's peak memory per phase next to the planner's in the summary."""
    run_dir = tmp_path / "run"
    overrides = [*TINY, "--training.steps=3", "--parallel.pp=2", "--training.micro_batch=2"]
    overrides += ["--profile.steps=[2, 3]", f"--run.dir={run_dir}", "--run.sample_tokens=0"]
    workers(2).run(traced_run, overrides)
    traces = run_dir / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["merged.json", "rank-00000.json", "rank-00001.json"]
    names = [
        {e["name"] for e in json.loads((traces / f"rank-0000{r}.json").read_text())["traceEvents"]}
        for r in (0, 1)
    ]
    for expected in ["step 2", "step 3", ALIGN, "forward chunk 0 micro-batch 3", "backward chunk 0 micro-batch 0",
                     "send activations chunk 0 micro-batch 1 to rank 1", "optimizer", "clip gradients"]:  # fmt: skip
        assert expected in names[0], expected
    assert "receive activations chunk 1 micro-batch 1 from rank 0" in names[1]
    assert "send on pp" in names[0] or "recv on pp" in names[1]
    merged = json.loads((traces / "merged.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert processes == {0: "rank 0", 100: "rank 1"}
    assert {e["pid"] for e in merged if e["ph"] == "C"} == {0, 100}  # a memory counter per rank
    aligned = [e["ts"] for e in merged if e.get("name") == ALIGN]
    assert len(aligned) == 2 and aligned[0] == pytest.approx(aligned[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["memory_by_phase"]) == 2
    for rank in summary["memory_by_phase"]:
        measured, planner = rank["measured"], rank["planner"]
        assert {"forward", "backward", "optimizer", "peak", "held_at_start", "communication_buffers"} <= set(
            measured
        )
        assert (
            measured["peak"] >= max(measured["forward"], measured["backward"]) > measured["held_at_start"] > 0
        )
        assert planner["total"] == pytest.approx(sum(v for k, v in planner.items() if k != "total"))


def test_merged_trace_shifts_each_rank_onto_rank_0s_clock(tmp_path):
    def trace(pid: int, align_ts: float, extra: list[dict]) -> Path:
        events = [
            {
                "name": ALIGN,
                "ph": "X",
                "ts": align_ts,
                "dur": 1.0,
                "pid": pid,
                "tid": 1,
                "cat": "user_annotation",
            },
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "python"}},
            {"name": "PyTorch Profiler (0)", "ph": "X", "ts": 0.0, "pid": "Spans", "tid": "x"},
            *extra,
        ]
        path = tmp_path / f"{pid}.json"
        path.write_text(json.dumps({"traceEvents": events}))
        return path

    flow = {"name": "kernel", "ph": "X", "ts": 25.0, "dur": 2.0, "pid": 0, "tid": 7, "id": 3}
    allocated = {"Total Allocated": 2**20, "Device Type": 0}
    memory = {"name": "[memory]", "ph": "i", "ts": 1003.0, "pid": 22, "tid": 1, "args": allocated}
    a = trace(11, 10.0, [{"name": "forward", "ph": "X", "ts": 12.0, "dur": 1.0, "pid": 11, "tid": 1}])
    b = trace(
        22,
        1000.0,
        [{"name": "forward", "ph": "X", "ts": 1004.0, "dur": 1.0, "pid": 22, "tid": 1}, flow, memory],
    )
    merged = merge_traces([a, b], tmp_path / "merged.json", device_type=0, memory_bases=[0.0, 3 * 2**20])
    events = json.loads(merged.read_text())["traceEvents"]
    spans = {(e["pid"], e["name"]): e for e in events if e["ph"] == "X"}
    assert spans[(0, "forward")]["ts"] == 12.0 and spans[(100, "forward")]["ts"] == 14.0
    assert spans[(101, "kernel")]["ts"] == 25.0 - 990.0 and spans[(101, "kernel")]["id"] == (1 << 40) + 3
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 100: "rank 1", 101: "rank 1: device 0"}
    assert all(isinstance(e["pid"], int) for e in events)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters == [
        {"name": "allocated MiB", "ph": "C", "ts": 13.0, "pid": 100, "args": {"allocated": 4.0}}
    ]


def test_memory_peaks_count_each_allocation_in_its_innermost_phase(tmp_path):
    def memory(ts: float, total: int, device: int = 0) -> dict:
        return {
            "name": "[memory]",
            "ph": "i",
            "ts": ts,
            "args": {"Total Allocated": total, "Device Type": device},
        }

    events = [
        {"name": "forward micro-batch 0", "ph": "X", "ts": 0.0, "dur": 10.0},
        {"name": "clip gradients", "ph": "X", "ts": 20.0, "dur": 10.0},
        {"name": "optimizer", "ph": "X", "ts": 22.0, "dur": 2.0},
        memory(1.0, 500), memory(5.0, 700), memory(15.0, 900), memory(21.0, 300), memory(23.0, 400),
        memory(23.5, 9999, device=1),
    ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    phases = {"forward micro-batch 0": "forward", "clip gradients": "backward", "optimizer": "optimizer"}
    peaks = memory_peaks(path, phases, device_type=0, base_bytes=100.0)
    assert peaks == {"forward": 800.0, "other": 1000.0, "backward": 400.0, "optimizer": 500.0, "peak": 1000.0}


def async_then_resume(overrides: list[str], root: str) -> tuple[list[dict], list[dict]]:
    """6 steps saving every 2, then the step-6 checkpoint removed and the run resumed from step 4."""
    rows = train_rows(overrides)
    published = [c.step for c in complete_checkpoints(Path(root))]
    trainer = trainer_for([*overrides, "--checkpoint.resume=true"])  # a collective barrier, then removal
    trainer.comm.barrier(trainer.job.place.world)
    if trainer.job.place.rank == 0:
        shutil.rmtree(Path(root) / "step-00000006")
    trainer.comm.barrier(trainer.job.place.world)
    return rows, train_rows([*overrides, "--checkpoint.resume=true"]), published


def test_async_checkpoints_resume_exactly(workers, tmp_path):
    """ZeRO-3 on 2 ranks saving in the background every 2 steps trains as without checkpoints, ends with
    its last checkpoint published (manifest and all), and resuming from one continues exactly."""
    base = [*TINY, "--training.micro_batch=4", "--run.sample_tokens=0", "--training.steps=6"]
    straight = workers(2).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    saving = [*base, "--checkpoint.every=2", "--checkpoint.async_save=true", f"--run.dir={tmp_path / 'run'}"]
    root = tmp_path / "run" / "checkpoints"
    rows, resumed, published = workers(2).run(async_then_resume, saving, str(root))[0]
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]
    assert published == [4, 6]
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[4:]]
    newest = complete_checkpoints(root)[-1]
    assert newest.step == 6 and (newest.path / "manifest.json").is_file() and not list(root.glob("*.tmp"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint_stall_s"]["mode"] == "async" and summary["checkpoint_stall_s"]["saves"] == 1


def interrupted_save(overrides: list[str]) -> list[int]:
    """Save step 2, then stop step 4's save after its files are written and before it is published (as a
    crash in the background would): what is complete on disk then."""
    from meshtron.checkpoint import async_save as checkpoint_async

    trainer = trainer_for(overrides)
    for step in range(2):
        trainer.step(step)
    trainer.save(2)
    trainer.checkpointer.wait()
    release, real = threading.Event(), checkpoint_async.publish
    checkpoint_async.publish = lambda *args: (release.wait(), real(*args))[1]
    try:
        for step in range(2, 4):
            trainer.step(step)
        trainer.save(4)
        trainer.comm.barrier(trainer.job.place.world)
        on_disk = [c.step for c in complete_checkpoints(Path(overrides[-1].split("=")[1]) / "checkpoints")]
        release.set()
        trainer.checkpointer.wait()
    finally:
        checkpoint_async.publish = real
    return on_disk


def test_a_save_cut_short_in_the_background_leaves_the_previous_checkpoint(workers, tmp_path):
    overrides = [*TINY, "--training.micro_batch=4", "--checkpoint.every=2", "--checkpoint.async_save=true"]
    on_disk = workers(2).run(interrupted_save, [*overrides, f"--run.dir={tmp_path}"])
    assert on_disk == [[2], [2]]
    assert [c.step for c in complete_checkpoints(tmp_path / "checkpoints")] == [2, 4]


def test_profile_steps_and_the_async_key_are_checked():
    cfg = load_config(None, [*TINY, "--checkpoint.async=true", "--profile.steps=[2, 3]"])
    assert cfg.checkpoint.async_save and cfg.profile.steps == [2, 3]
    for steps in ("[0, 2]", "[3, 2]", "[1, 11]", "[4]"):
        with pytest.raises(ConfigError, match="profile.steps"):
            check(load_config(None, [*TINY, f"--profile.steps={steps}"]))


def test_the_profile_steps_flag_sets_profile_steps():
    """--profile-steps FIRST,LAST (or FIRST-LAST) is profile.steps, checked as the key is."""
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--config", "configs/demo.toml", "--profile-steps", "2-3000"],
        capture_output=True, text=True, check=False, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert out.returncode != 0
    assert (
        "profile.steps=[2, 3000] must be [first, last] with 1 <= first <= last <= training.steps"
        in out.stderr
    )
