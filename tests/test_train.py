"""The trainer: the loss falls on the default corpus, accumulation and replicated data parallel reproduce
the single-device run, metrics are written, unimplemented layouts are refused up front."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.models.llama import build_model
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.rules.checks import load_config, not_yet_supported
from meshtron.testing.parity import drop_trainer, relative, ring, train_rows, trainer_for
from meshtron.testing.tiny import MOE
from meshtron.testing.tiny import TINY as TINY_10_STEPS
from meshtron.train.optim import lr_at
from meshtron.train.trainer import train

TINY = [*TINY_10_STEPS, "--training.micro_batch=8"]


def run_train(overrides: list[str]) -> list[dict]:
    return train(load_config(None, overrides))


def test_loss_falls_on_default_corpus(tmp_path):
    rows = run_train(
        [
            "--model.dim=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--model.n_kv_heads=2",
            "--model.ffn_dim=176",
            "--model.vocab_size=4096",
            "--training.steps=40",
            "--training.seq_len=64",
            "--training.global_batch=8",
            "--training.micro_batch=8",
            "--training.lr=1e-2",
            "--training.warmup_steps=5",
            f"--run.dir={tmp_path}",
            "--run.plot=true",
        ]
    )
    first = rows[0]["loss"]
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert first == pytest.approx(8.3, abs=0.3)  # ~ln(4096): an untrained model is uniform
    assert last < first - 1.2, (first, last)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 40
    row = json.loads(lines[-1])
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "peak_mem_bytes", "comm_bytes"):
        assert key in row
    assert row["step"] == 40 and row["tokens_per_sec"] > 0 and 0 < row["mfu"] < 1
    assert row["peak_mem_bytes"] > 10_000_000 and row["comm_bytes"] == 0
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    whole = run_train([*TINY, "--training.steps=4", f"--run.dir={tmp_path / 'a'}"])
    accumulated = run_train(
        [*TINY, "--training.steps=4", "--training.micro_batch=2", f"--run.dir={tmp_path / 'b'}"]
    )
    for a, b in zip(accumulated, whole, strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-5
        assert relative(a["grad_norm"], b["grad_norm"]) <= 1e-4


def test_moe_and_bf16_train(tmp_path):
    """An MoE model learns (the loss falls by 10% in 8 steps), and bf16 autocast tracks fp32 within 0.5%
    at every step."""
    common = [*TINY, *MOE, "--training.steps=8"]
    fp32 = run_train([*common, f"--run.dir={tmp_path / 'fp32'}"])
    bf16 = run_train([*common, "--training.dtype=bf16", f"--run.dir={tmp_path / 'bf16'}"])
    for rows in (fp32, bf16):
        assert rows[-1]["loss"] < 0.9 * rows[0]["loss"], [r["loss"] for r in rows]
    for a, b in zip(bf16, fp32, strict=True):
        assert relative(a["loss"], b["loss"]) < 5e-3, (a["loss"], b["loss"])


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_data_parallel_matches_single_device(workers, tmp_path, world):
    steps = ["--training.steps=5", "--training.micro_batch=1"]
    single = run_train([*TINY, *steps, f"--run.dir={tmp_path / 'single'}"])
    results = workers(world).run(
        train_rows, [*TINY, *steps, f"--parallel.dp_replicate={world}", f"--run.dir={tmp_path / 'dp'}"]
    )
    parallel = results[0]
    assert all(r == [] for r in results[1:])  # only rank 0 logs
    for p, s in zip(parallel, single, strict=True):
        assert relative(p["loss"], s["loss"]) <= 1e-5, (p["loss"], s["loss"])
        assert relative(p["grad_norm"], s["grad_norm"]) <= 1e-4
    n_params = build_model(load_config(None, TINY).model).num_params()
    # One all-reduce of every gradient and one of the loss per step; a step counts only its own
    # collectives (comm.recording), so step 1 leaves out the set-up's (the weights' broadcast, barriers).
    for row in parallel:
        assert row["comm_bytes"] == (2 * 4 * n_params + 2 * 4) * ring(world)
        assert row["comm_calls_by_group"] == {"dp": 2}


def test_unimplemented_layouts_are_refused():
    def refusals(overrides: list[str], world: int) -> str:
        return " ".join(not_yet_supported(load_config(None, overrides), world))

    assert refusals(["--parallel.cp=2"], 2) == ""
    assert refusals([*MOE, "--parallel.ep=2"], 2) == ""
    assert "use parallel.fsdp_impl='meshtron' with parallel.ep > 1" in refusals(
        [*MOE, "--parallel.ep=2", "--parallel.fsdp_impl=torch"], 2
    )
    torch_fsdp = ["--parallel.fsdp_impl=torch", "--parallel.dp_shard=2"]
    assert "fully_shard is not wired into the pipeline runtime" in refusals(
        [*torch_fsdp, "--parallel.pp=2"], 4
    )
    assert "set parallel.zero=3, not 1" in refusals([*torch_fsdp, "--parallel.zero=1"], 2)
    assert refusals([*torch_fsdp, "--checkpoint.every=5", "--parallel.tp=2"], 4) == ""  # tests/test_fuzz.py
    assert refusals(torch_fsdp, 2) == ""


def test_steps_of_degree_one_change_nothing():
    """The config is checked once, up front (checks.check); a composition step takes its group and plain
    settings, and with one rank it leaves the model as it is."""
    cfg = load_config(None, [*TINY, *MOE])
    model = build_model(cfg.model)
    before = {name: p.clone() for name, p in model.named_parameters()}
    apply_expert_parallel(model, Comm(), CommGroup("ep", (0,), None), "alltoall")
    assert apply_context_parallel(model, Comm(), CommGroup("cp", (0,), None), "ring", 32) is None
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert "attend" not in vars(model.layers["0"].attention)


def test_lr_schedule_warmup_then_cosine():
    t = load_config(
        None,
        [
            "--training.steps=110",
            "--training.warmup_steps=10",
            "--training.lr=1.0",
            "--training.min_lr_ratio=0.1",
        ],
    ).training
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(109, t) == pytest.approx(0.1)
    assert lr_at(60, t) == pytest.approx(0.55, abs=0.01)


def test_checkpoint_resume_is_exact(tmp_path):
    base = [*TINY, "--model.name=tiny-moe", "--training.steps=6", "--training.micro_batch=4"]
    straight = run_train([*base, f"--run.dir={tmp_path / 'straight'}"])
    run_dir = f"--run.dir={tmp_path / 'resumed'}"
    first = run_train(
        [
            *base,
            run_dir,
            "--training.steps=6",
            "--checkpoint.every=3",
            "--checkpoint.keep=1",
            "--training.steps=3",
        ]
    )
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()] == ["step-00000003"]
    # Starting afresh over a checkpoint is refused, so nothing is overwritten by accident.
    from meshtron.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="set --checkpoint.resume=true"):
        run_train([*base, run_dir])
    second = run_train([*base, run_dir, "--checkpoint.resume=true", "--checkpoint.every=3"])
    assert [r["step"] for r in second] == [4, 5, 6]
    for a, b in zip(first + second, straight, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]


def test_incomplete_checkpoint_is_ignored_and_mismatch_is_clear(tmp_path):
    from meshtron.checkpoint import CheckpointError
    from meshtron.checkpoint.save_load import complete_checkpoints

    base = [*TINY, "--training.steps=2", "--checkpoint.every=2", f"--run.dir={tmp_path}"]
    run_train(base)
    root = tmp_path / "checkpoints"
    (root / "step-00000009.tmp").mkdir()  # what a crash during a save leaves behind
    assert [c.step for c in complete_checkpoints(root)] == [2]
    with pytest.raises(CheckpointError, match="does not fit this model"):
        run_train([*base, "--checkpoint.resume=true", "--model.n_layers=3", "--training.steps=4"])


def test_a_sample_names_ids_its_tokenizer_cannot_decode():
    """A model's vocabulary may be larger than its tokenizer's (the tiny preset's 512 over bytes' 257): an
    id past it shows as <id N> instead of failing the end of a finished run."""
    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.train.sample import readable

    tok = ByteTokenizer()
    ids = [*tok.encode("ab"), 300, *tok.encode("c"), 511]
    assert readable(tok.decode, ids, tok.vocab_size) == "ab<id 300>c<id 511>"
    assert readable(tok.decode, tok.encode("plain"), tok.vocab_size) == "plain"


def trainers_left_alive(layouts: list[list[str]]) -> list[bool]:
    """For each layout: a trainer that took a step and was then dropped, whether its model is still alive
    after a collection (the engines' and tensor parallel's gradient hooks once held them: autograd keeps a
    parameter's hooks where the collector cannot see them, and a worker ran out of threads)."""
    alive = []
    for overrides in layouts:
        trainer = trainer_for([*TINY_10_STEPS, "--training.micro_batch=2", *overrides])
        trainer.step(0)
        model = weakref.ref(trainer.model)
        drop_trainer(trainer)  # the harness's own reference (testing/parity.py), not a hook's
        del trainer
        gc.collect()
        alive.append(model() is not None)
    return alive


def test_a_dropped_trainer_is_collected(workers):
    layouts = [
        ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],  # DDP
        ["--parallel.dp_shard=2", "--parallel.zero=1"],  # ZeRO-1 (DDP's buckets)
        ["--parallel.dp_shard=2"],  # ZeRO-3
        ["--parallel.dp_shard=1", "--parallel.tp=2"],  # tensor parallel's gradient sums
    ]
    assert workers(2).run(trainers_left_alive, layouts)[0] == [False] * len(layouts)
