"""Two "nodes" on this machine: two torchrun agents meeting at a c10d rendezvous train one job whose
pipeline crosses them, and its losses match the same model trained in one process; with a rank killed
mid-run, the documented multi-node restart recipe (docs/launching.md) resumes and still matches."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from meshtron.testing.tiny import TINY

ROOT = Path(__file__).resolve().parents[1]
NPROC_PER_NODE = 2
# pp=2 x dp_shard=2 on 2 ranks per node: ranks 0-1 (stage 0) on one node, 2-3 (stage 1) on the other,
# so every activation and gradient between the stages goes from one node to the other
# (`meshtron mesh --pp 2 --dp-shard 2 --gpus-per-node 2` says "dims crossing nodes: pp").
LAYOUT = ["--parallel.pp=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]
COMMON = [*TINY, "--training.steps=3", "--run.device=cpu"]  # cpu even where GPUs are
TIMEOUT_S = 240


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (as if pytest ran under torchrun), one thread."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.pop("MESHTRON_KILL_AT", None)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return [r["loss"] for r in rows]


def assert_same_losses(many: list[float], single: list[float]) -> None:
    for a, b in zip(many, single, strict=True):
        assert abs(a - b) / b <= 1e-5, (many, single)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The tiny preset with nothing else: every other key comes from TINY and the defaults."""
    path = tmp_path_factory.mktemp("config") / "tiny.toml"
    path.write_text('[model]\nname = "tiny"\n')
    return path


@pytest.fixture(scope="module")
def one_process_losses(config, tmp_path_factory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("one")
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron",
            "train",
            f"--config={config}",
            *COMMON,
            f"--run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        env=clean_env(),
    )
    assert one.returncode == 0, one.stderr
    return read_losses(run_dir)


def stop(proc: subprocess.Popen) -> None:
    """End a node: its agent and the ranks it started, which share its process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_two_nodes(
    tmp_path: Path, train_args: list[str], env: dict[str, str], max_restarts: int = 0
) -> tuple[list[int | None], list[str], str]:
    """Two torchrun agents of NPROC_PER_NODE ranks each, started together; both ended by the deadline or
    as soon as one fails. Returns (exit codes, each node's output, a report of both for assertions)."""
    port, run_id = free_port(), f"meshtron-test-{uuid.uuid4().hex[:8]}"
    nodes: list[subprocess.Popen] = []
    logs = []
    try:
        for node_rank in range(2):
            log = open(tmp_path / f"node{node_rank}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node_rank}",  # informational: c10d orders the nodes itself
                f"--nproc-per-node={NPROC_PER_NODE}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={run_id}",
                # Both "nodes" share one address, so say which one hosts the rendezvous store (on real
                # nodes the agent on the endpoint's host finds that out by itself).
                f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}",
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.5",
                "-m",
                "meshtron",
                "train",
                *train_args,
            ]
            nodes.append(
                subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=env,
                    start_new_session=True,  # its own process group, so stop() ends its ranks too
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in nodes):
                break  # one node failed: the other would wait for it until its own timeout
            time.sleep(0.5)
    finally:
        for proc in nodes:
            stop(proc)
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"node{n}.log").read_text() for n in range(len(nodes))]
    report = "\n".join(
        f"--- node {n} (exit {p.returncode}) ---\n{out[-4000:]}"
        for n, (p, out) in enumerate(zip(nodes, outputs, strict=True))
    )
    return [p.returncode for p in nodes], outputs, report


def test_two_nodes_with_pipeline_across_them_match_one_process(tmp_path, config, one_process_losses):
    run_dir = tmp_path / "two"
    codes, outputs, report = run_two_nodes(
        tmp_path, [f"--config={config}", *COMMON, *LAYOUT, f"--run.dir={run_dir}"], clean_env()
    )
    assert codes == [0, 0], report
    # Global rank 0 alone prints: one node printed the job's summary and steps, the other nothing of
    # them. Global rank = node rank x 2 + local rank, so that node holds ranks 0-1 (pp stage 0) and the
    # other ranks 2-3 (stage 1): the pipeline crossed the nodes.
    printed = [out for out in outputs if "world 4 (cpu), mesh pp2 x dp_replicate1 x dp_shard2" in out]
    assert len(printed) == 1 and printed[0].count("\nstep ") == 3, report
    assert_same_losses(read_losses(run_dir), one_process_losses)


def test_two_nodes_restart_after_a_rank_dies_and_resume(tmp_path, config, one_process_losses):
    """Rank 2 (on the second node) dies after step 1 and its checkpoint. Its agent restarts its ranks
    (TORCHELASTIC_RESTART_COUNT=1), the other agent sees the new rendezvous round and restarts its own
    as a membership change (its count stays 0). With docs/launching.md's multi-node recipe, a fresh
    store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and checkpoint.resume=true, every rank meets
    again on one restart and resumes at step 1; steps 2-3 match the run that never failed."""
    run_dir = tmp_path / "two"
    args = [f"--config={config}", *COMMON, *LAYOUT, "--checkpoint.every=1", "--checkpoint.resume=true"]
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", MESHTRON_KILL_AT="2:1")
    codes, outputs, report = run_two_nodes(tmp_path, [*args, f"--run.dir={run_dir}"], env, max_restarts=1)
    assert codes == [0, 0], report
    assert sum(out.count("meshtron: resumed from") for out in outputs) == 1, report
    assert "checkpoints/step-00000001 at step 1" in report
    assert_same_losses(read_losses(run_dir), one_process_losses)
