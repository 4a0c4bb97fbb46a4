"""Replica groups that fail and heal (fault_tolerance.enabled, train/fault_tolerance.py), run as a user runs
them: `meshtron train --nproc 4 --parallel.dp_replicate=2`, one rank SIGKILLed as a step begins
(MESHTRON_KILL_RANK). The run must finish with every step logged once, rows with one live group and the
last with two, the healthy group never restarted, and the groups' bytes equal at the end; and its losses
must be those of a replay of its live-group history written here in plain torch: one model, each step's
loss the token mean over the live groups' shares of the global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtron.config.schema import ConfigError
from meshtron.data.dataset import META_FILE, prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.models.llama import build_model
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import relative, trainer_for
from meshtron.testing.tiny import TINY
from meshtron.train.fault_tolerance import FaultTolerance, ReplicaShare, checksum
from meshtron.train.optim import build_optimizer, lr_at

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
# Four ranks, two replica groups of two. Each group's rank 0 sleeps 0.4 s in every forward
# (MESHTRON_SLOW_RANK names a group's own rank), so that the killed group is back while steps are left
# (its restart, 4 processes starting on 2 busy cores, took over 16 steps at 0.3 s once).
SLOW = "0:0.4"
# AdamW's step m / (sqrt(v) + eps) on an embedding row whose token barely occurs amplifies the fp32
# summation-order noise of its gradient: one run's history put one row (of 512) 4.3e-4 off the replay,
# 1.16e-4 of the table's norm, with every other tensor within 7e-6 of its norm and every loss within 2e-7.
EMBEDDING_RTOL = {"tok_embeddings.weight": 1e-3}
COMMON = [
    *TINY,
    f"--training.steps={STEPS}",
    "--training.micro_batch=2",
    "--parallel.dp_replicate=2",
    "--checkpoint.every=0",
    "--run.sample_tokens=0",
    "--run.log_every=5",
]


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory) -> str:
    """`--data.path=` a byte-level dataset of the docs in which a fixed 30% of the targets do not count (a
    loss mask): each step's loss divides by the counted targets of the live groups' shares."""
    out = tmp_path_factory.mktemp("masked") / "data"
    data = prepare_data(sorted((ROOT / "docs").glob("*.md")), out, tokenizer="byte", progress=False)
    mask = (np.random.default_rng(0).random(data.n_tokens) > 0.3).astype(np.uint8)
    mask.tofile(out / "mask.bin")
    meta = json.loads((out / META_FILE).read_text())
    (out / META_FILE).write_text(json.dumps({**meta, "loss_mask": "mask.bin"}))
    return f"--data.path={out}"


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`meshtron train --nproc 4` on the demo config with `args`, the drill `env` in its environment."""
    return subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--config", "configs/demo.toml", "--nproc", "4", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def train(run_dir: Path, layout: list[str], env: dict[str, str], ft: bool = True) -> tuple[str, list[dict]]:
    """`launch` with `layout`, which must succeed; (its output, its metrics rows)."""
    args = [*COMMON, *layout, f"--run.dir={run_dir}", f"--fault_tolerance.enabled={str(ft).lower()}"]
    out = launch(args, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out.stdout, rows


def replay(overrides: list[str], history: list[list[int]]) -> dict:
    """The run's live-group history replayed on one device: at step s, one AdamW step on the token mean
    of the cross-entropy over the shares of global batch s of the groups in history[s]."""
    trainer = trainer_for([*overrides, "--parallel.dp_replicate=1"])  # the data and the config, one rank
    cfg, job, t = trainer.cfg, trainer.job, trainer.cfg.training
    model = build_model(cfg.model, seed=t.seed)
    optimizer = build_optimizer(list(model.parameters()), t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay)
    losses = []
    for step, groups in enumerate(history):
        shares = [job.sampler.rank_batch(job.dataset, step, g, 2) for g in groups]
        inputs, targets = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def saved_weights(overrides: list[str]) -> dict[str, torch.Tensor]:
    """The whole weights of the newest checkpoint in the run's directory, loaded on one rank."""
    trainer = trainer_for([*overrides, "--parallel.dp_replicate=1", "--checkpoint.resume=true"])
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_survived(stdout: str, rows: list[dict], run_dir: Path) -> list[list[int]]:
    """The checks every drill shares; returns the live groups of each step."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once
    history = [r["replicas"]["groups"] for r in rows]
    assert [0] in history and history[-1] == [0, 1]
    assert all(
        r["replicas"]["live"] == len(g) and r["replicas"]["of"] == 2
        for r, g in zip(rows, history, strict=True)
    )
    assert "replica group 0 of 2 started (attempt 1)" not in stdout  # the healthy group never restarted
    assert "replica group 1 of 2 started (attempt 1)" in stdout and "replica group 1 healed" in stdout
    assert json.loads((run_dir / "summary.json").read_text())["replicas_equal"] is True
    return history


@pytest.mark.parametrize(
    "layout,drill",
    [
        (["--parallel.dp_shard=2"], {"MESHTRON_KILL_RANK": "3:5"}),  # the drill: ZeRO-3 inside
        # tp 2 inside, and the killed rank killed again as it heals: its group restarts twice
        (
            ["--parallel.tp=2", "--parallel.sp=true"],
            {"MESHTRON_KILL_RANK": "2:5", "MESHTRON_KILL_HEALING": "2"},
        ),
        # pp 2 inside, a loss mask, and the lowest live group's checkpoint at the end (against the replay's
        # weights)
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", f"--checkpoint.every={STEPS}", "masked"],
            {"MESHTRON_KILL_RANK": "3:6"},
        ),
    ],
    ids=["dp_shard2", "tp2-killed-healing", "pp2"],
)
def test_a_killed_replica_group_heals_and_the_run_equals_its_replay(
    workers, tmp_path, masked_data, layout, drill
):
    data = [masked_data] if "masked" in layout else []
    layout = [arg for arg in layout if arg != "masked"] + data
    stdout, rows = train(tmp_path, layout, {**drill, "MESHTRON_SLOW_RANK": SLOW})
    history = assert_survived(stdout, rows, tmp_path)
    if "MESHTRON_KILL_HEALING" in drill:
        assert "replica group 1 of 2 started (attempt 2)" in stdout
    expected = workers(1).run(replay, [*COMMON, *data], history)[0]  # (the same model on one device)
    for step, (row, want) in enumerate(zip(rows, expected["losses"], strict=True), 1):
        assert relative(row["loss"], want) <= 1e-5, (step, row["loss"], want)
    if any(arg.startswith("--checkpoint.every") for arg in layout):
        saved = workers(1).run(saved_weights, [*COMMON, *data, f"--run.dir={tmp_path}"])[0]
        for name, want in expected["weights"].items():  # (AdamW: within 1e-4 of each tensor's norm)
            assert (saved[name] - want).norm() <= EMBEDDING_RTOL.get(name, 1e-4) * want.norm(), name


def test_a_moe_replica_group_heals_its_balancing_bias_too(tmp_path):
    """Experts over ep 2 inside each group, DeepSeek-V3's balancing bias moving on the loads of the live
    groups' tokens: healed with the rest (the summary's equality covers the model's buffers)."""
    moe = ["--model.name=tiny-moe", "--model.router=sigmoid", "--model.router_bias_rate=0.01"]
    layout = [*moe, "--parallel.dp_shard=2", "--parallel.ep=2"]
    stdout, rows = train(tmp_path, layout, {"MESHTRON_KILL_RANK": "2:6", "MESHTRON_SLOW_RANK": SLOW})
    assert_survived(stdout, rows, tmp_path)
    tokens = 8 * 32 * 2  # the global batch's assignments (top-2): both groups' loads, summed
    assert sum(rows[-1]["moe"]["layers.0"]["load"]) == tokens
    alone = next(r for r in rows if r["replicas"]["live"] == 1)
    assert sum(alone["moe"]["layers.0"]["load"]) == tokens // 2


def test_without_a_failure_fault_tolerance_changes_nothing(workers, tmp_path, masked_data):
    """The same layout (HSDP: ZeRO-3 over 2, replicated over 2) with and without fault tolerance, on data
    with a loss mask: the same gradient norms and final weights bit for bit; the loss metric is summed in
    another order (within one rounding)."""
    layout = ["--parallel.dp_shard=2", "--training.steps=6", "--checkpoint.every=6", masked_data]
    _, with_ft = train(tmp_path / "ft", layout, {})
    _, without = train(tmp_path / "plain", layout, {}, ft=False)
    assert [r["grad_norm"] for r in with_ft] == [r["grad_norm"] for r in without]
    for a, b in zip(with_ft, without, strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-6
        assert a["replicas"] == {"live": 2, "of": 2, "groups": [0, 1]} and "replicas" not in b
    pool = workers(1)
    runs = [[*COMMON, masked_data, f"--run.dir={tmp_path / d}"] for d in ("ft", "plain")]
    saved = [pool.run(saved_weights, run)[0] for run in runs]
    assert all(torch.equal(saved[0][name], saved[1][name]) for name in saved[1])


def test_every_replica_group_dying_is_refused_with_the_way_on(tmp_path):
    """Both groups killed at step 4: no live group holds the weights; the restarted ones say so and the
    job ends (never a hang, never a silent restart from step 1)."""
    args = [*COMMON, "--parallel.dp_shard=2", f"--run.dir={tmp_path}", "--fault_tolerance.enabled=true"]
    out = launch(args, {"MESHTRON_KILL_RANK": "1:4,3:4"})
    assert out.returncode == 1
    assert "the job had reached step 3 and no replica group is left that holds it" in out.stderr
    assert "--checkpoint.resume=true" in out.stderr


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["--parallel.dp_shard=4"], "needs parallel.dp_replicate >= 2"),
        (["--parallel.dp_replicate=2", "--fault_tolerance.diloco_every=2"], "not supported yet"),
        (["--parallel.dp_replicate=2", "--parallel.fsdp_impl=torch"], "needs meshtron's engines"),
    ],
)
def test_layouts_it_cannot_heal_are_refused_before_work_starts(overrides, says):
    cfg = load_config(ROOT / "configs/demo.toml", [*TINY, "--fault_tolerance.enabled=true", *overrides])
    with pytest.raises(ConfigError, match=says):
        check(cfg, 4)


def test_a_group_takes_its_share_of_the_whole_jobs_batch():
    """Group g's rank r takes what dp_replicate coordinate g, dp_shard coordinate r would take in the
    whole job, and the data position is the whole job's."""

    class Tokens:
        n_tokens, path = 33 * 64, "tokens"
        tokens = torch.arange(33 * 64).numpy()
        loss_mask = None

    whole = BatchSampler(Tokens.n_tokens, 32, 8, seed=0)
    share = ReplicaShare(BatchSampler(Tokens.n_tokens, 32, 8, seed=0), 1, 2)
    got = share.next_micro_batches(Tokens, 1, 2, 2)  # group 1, its rank 1 of 2
    want = whole.micro_batches(Tokens, 0, 3, 4, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want, strict=True))
    assert share.step == 1 and share.state_dict() == {**whole.state_dict(), "step": 1}


def test_a_group_that_restarts_during_the_jobs_last_step_ends_well(monkeypatch, capsys):
    """A restarted group that asks for a quorum while the live groups take the job's last step finds
    itself alone behind them, then the job done: it takes no step and ends well (it used to report the
    replicas lost and fail a job that had finished)."""

    class Groups:
        index, count = 1, 2
        reads = iter([STEPS - 1, STEPS])  # the job's step before the quorum, and after it

        def set_step(self, step):
            pass

        def job_step(self):
            return next(self.reads)

        def start_step(self, step):
            return step  # alone: its own step 0

        def live(self):
            return 1

        def report_fatal(self, message):
            raise AssertionError(f"reported fatal: {message}")

    job = types.SimpleNamespace(place=types.SimpleNamespace(rank=0, world_size=2))
    cfg = load_config(ROOT / "configs/demo.toml", [*COMMON, "--fault_tolerance.enabled=true"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    replicas = FaultTolerance(job, Groups(), cfg)
    assert replicas.begin(0) == STEPS and replicas.idle
    assert "restarted after the job's last step" in capsys.readouterr().out


def test_the_equality_checksum_sees_one_changed_bit():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[517] ^= 1
    assert checksum(t) == checksum(t.clone()) and checksum(t) != checksum(flipped)


def test_a_lighthouse_that_is_not_there_is_named_within_the_deadline(tmp_path):
    """A group started under a launcher of the user's own (torchrun) with a wrong TORCHFT_LIGHTHOUSE:
    the run ends within run.comm_timeout_s, naming the address it could not reach."""
    args = [*TINY, "--parallel.dp_replicate=2", "--fault_tolerance.enabled=true", "--run.comm_timeout_s=3"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    out = subprocess.run(
        [*launch, "-m", "meshtron", "train", "--config", "configs/demo.toml", *args, f"--run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MESHTRON_REPLICA_GROUP": "0",
            "TORCHFT_LIGHTHOUSE": "http://localhost:1",
        },
    )
    assert out.returncode != 0
    assert (
        "replica group 0 could not reach the lighthouse at http://localhost:1 (TORCHFT_LIGHTHOUSE)"
        in out.stderr
    )
