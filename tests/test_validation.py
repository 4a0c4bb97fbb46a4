"""Validation and honest throughput: the held-out split is disjoint and fixed, the validation loss of every
layout is the single device's, evaluating changes nothing of training, metrics rows and the run summary
are written, MFU is never shown above 100%, and the CPU's reference rate is measured once and reused."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshtron.data import DataError
from meshtron.data.dataset import prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.data.validation import split_validation, validation_sampler
from meshtron.probe import peak
from meshtron.rules.checks import load_config, validate
from meshtron.testing.parity import relative, val_losses
from meshtron.testing.tiny import TINY
from meshtron.train.trainer import train

VAL = ["--data.val_fraction=0.01", "--training.eval_every=1", "--training.eval_batches=2"]


@pytest.fixture
def small_data(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    return prepare_data([tmp_path / "corpus.txt"], tmp_path / "data")


def test_val_split_is_disjoint_and_deterministic(small_data):
    cfg = load_config(None, ["--training.seq_len=31", "--training.global_batch=4", "--data.val_fraction=0.1"])
    train_data, val = split_validation(cfg, small_data)
    cut = train_data.n_tokens
    assert cut + val.n_tokens == small_data.n_tokens and val.n_tokens == round(0.1 * small_data.n_tokens)
    assert np.array_equal(train_data.tokens, small_data.tokens[:cut])
    assert np.array_equal(val.tokens, small_data.tokens[cut:])
    # Every training window lies before the cut (the validation windows after it, by construction).
    sampler = BatchSampler(train_data.n_tokens, 31, 4, seed=0)
    windows = np.concatenate([sampler.global_indices(s) for s in range(3 * int(sampler.steps_per_epoch))])
    assert (windows.max() + 1) * 32 <= cut
    # The evaluated batches: the same at every call and from any sampler built for them.
    first = validation_sampler(cfg.training, val).micro_batches(val, 0, 0, 1, 4)
    again = validation_sampler(cfg.training, val).micro_batches(val, 0, 0, 1, 4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    # Without validation the training data is untouched, so the training stream is as before.
    off = load_config(None, ["--training.seq_len=31", "--training.global_batch=4"])
    assert split_validation(off, small_data) == (small_data, None)


def test_validation_rules_and_a_too_small_split_are_refused(small_data):
    def problems(*overrides: str) -> str:
        return " ".join(validate(load_config(None, list(overrides))))

    assert "data.val_fraction=1.0 must be in [0, 1)" in problems("--data.val_fraction=1.0")
    assert "data.val_fraction=-0.1 must be in [0, 1)" in problems("--data.val_fraction=-0.1")
    both = problems("--data.val_fraction=0.1", "--data.val_path=x")
    assert "keep one (--data.val_fraction=0 or --data.val_path= on the command line unsets one)" in both
    assert "training.eval_every=5 needs validation data" in problems("--training.eval_every=5")
    assert "training.eval_batches=0 must be positive" in problems("--training.eval_batches=0")
    assert problems(*VAL) == ""
    cfg = load_config(
        None, ["--training.seq_len=31", "--training.global_batch=4", "--data.val_fraction=0.002"]
    )
    with pytest.raises(
        DataError, match=r"fewer than training.eval_batches x global_batch = 1 x 4 = 4; raise"
    ):
        split_validation(cfg, small_data)


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.tp=2"],
        ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--training.micro_batch=2"],
        ["--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=4"],
        ["--parallel.cp=2"],
    ],
    ids=["tp2", "pp2-1f1b", "zero3-dp2", "cp2"],
)
def test_val_loss_equals_single_device(workers, layout):
    """Two steps, each followed by an evaluation: training and validation losses equal one device's."""
    base = [*TINY, *VAL, "--training.micro_batch=8"]
    single = workers(1).run(val_losses, base)[0]
    results = workers(2).run(val_losses, [*base, *layout])
    for got in results:  # every rank returns the reduced value
        for (loss, val), (want_loss, want_val) in zip(got, single, strict=True):
            assert relative(loss, want_loss) <= 1e-5 and relative(val, want_val) <= 1e-5, (got, single)


def test_val_loss_under_a_v_pipeline_equals_single_device(workers):
    """Evaluation walks a V too: chunk 0 and the head on rank 0, the turn on rank 1 kept in memory."""
    base = [*TINY, *VAL, "--training.micro_batch=8", "--model.n_layers=4"]
    single = workers(1).run(val_losses, base)[0]
    v = ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--parallel.vpp=2", "--training.micro_batch=2"]
    for got in workers(2).run(val_losses, [*base, *v]):
        for (loss, val), (want_loss, want_val) in zip(got, single, strict=True):
            assert relative(loss, want_loss) <= 1e-5 and relative(val, want_val) <= 1e-5, (got, single)


def test_evaluating_changes_nothing_of_training(workers):
    """ZeRO-3 without resharding after forward (a forward-only pass must free the gathered units itself)."""
    run = [
        *TINY,
        *VAL,
        "--parallel.dp_shard=2",
        "--parallel.reshard_after_forward=false",
        "--training.micro_batch=4",
    ]
    with_eval = workers(2).run(val_losses, run, 3)[0]
    without = workers(2).run(val_losses, run, 3, False)[0]
    assert [loss for loss, _ in with_eval] == [loss for loss, _ in without]
    assert with_eval[0][1] > with_eval[-1][1]  # and the model improves on held-out text


def test_metrics_rows_summary_and_plot(tmp_path, capsys):
    rows = train(
        load_config(
            None,
            [*TINY, "--data.val_fraction=0.01", "--training.eval_every=2", "--training.steps=3"]
            + ["--training.micro_batch=8", f"--run.dir={tmp_path}", "--run.plot=true"],
        )
    )
    assert [r["step"] for r in rows] == [1, 2, 3]  # train() returns the training rows
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 3]  # every eval_every steps and after the last
    assert val[-1]["val_ppl"] == pytest.approx(np.exp(val[-1]["val_loss"]))
    for row in (r for r in lines if "loss" in r):
        assert row["tokens_per_sec"] > 0 and row["step_time_s"] > 0 and 0 < row["mfu"] <= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["median_tokens_per_sec"] == pytest.approx(np.median([r["tokens_per_sec"] for r in rows]))
    assert 0 < summary["median_mfu"] <= 1 and summary["peak_mem_bytes"] > 0 and summary["wall_time_s"] > 0
    assert (
        summary["final_train_loss"] == rows[-1]["loss"] and summary["final_val_loss"] == val[-1]["val_loss"]
    )
    out = capsys.readouterr().out
    assert "; MFU relative to this CPU's measured float32 matmul rate with " in out
    assert f"val loss {val[0]['val_loss']:.4f}" in out and "meshtron: summary: 3 steps" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_mfu_is_never_shown_above_100_percent(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "cpu_peak", lambda dtype: (1e3, "a reference measured far too low"))
    remeasured = []  # a step beats the reference: measured again, still too low (a busy machine)
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda dtype: remeasured.append(dtype) or 2e3)
    monkeypatch.setattr(peak, "_MEASURED_AGAIN", set())
    rows = train(load_config(None, [*TINY, "--training.steps=2", f"--run.dir={tmp_path}"]))
    assert all(r["mfu"] is None and r["mfu_note"] == peak.OVER_100 for r in rows)
    out = capsys.readouterr().out
    assert re.findall(r"MFU (?!relative)(\S+)", out) == [
        ">100%",
        ">100%",
        ">100%",
    ]  # two steps and the summary
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["median_mfu"] is None and summary["mfu_note"] == peak.OVER_100
    assert "measured again when a step beat the reference" in summary["mfu_reference"]
    assert remeasured == [torch.float32]  # once, not at every step that beats it (bf16 on a CPU: 48 s)
    assert peak.shown_mfu(float("nan")) == (None, "n/a") and peak.shown_mfu(0.4) == (0.4, None)


def test_a_step_beating_a_busy_start_ups_reference_measures_again_and_shows_a_number(tmp_path, monkeypatch):
    """Issue 37.1: the reference measured while the machine was busy is raised by the first step that
    beats it, and the MFU shown is a number again, below 100%."""
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "cpu_peak", lambda dtype: (1e3, "a reference measured far too low"))
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda dtype: 1e15)  # the quiet machine's figure
    monkeypatch.setattr(peak, "_MEASURED_AGAIN", set())
    rows = train(load_config(None, [*TINY, "--training.steps=2", f"--run.dir={tmp_path}"]))
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)


def test_cpu_reference_rate_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    monkeypatch.delenv("MESHTRON_REPROBE", raising=False)
    monkeypatch.setattr(peak, "_MEMO", {})
    measured = []
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda dtype: measured.append(dtype) or 5e10)
    rate, source = peak.cpu_peak(torch.float32)
    assert rate == 5e10 and "best measured" in source and measured == [torch.float32]
    peak._MEMO.clear()  # a new process: the figure comes from the file
    rate, source = peak.cpu_peak(torch.float32)
    assert rate == 5e10 and "cached in" in source and measured == [torch.float32]
    entry = next(iter(json.loads((tmp_path / peak.CACHE_FILE).read_text())))
    assert f"|{torch.get_num_threads()} threads|float32|" in entry
    peak.cpu_peak(torch.bfloat16)  # another dtype is another figure
    peak.cpu_peak(torch.float32, reprobe=True)  # MESHTRON_REPROBE=1
    assert measured == [torch.float32, torch.bfloat16, torch.float32]


def test_cpu_reference_rate_keeps_the_best_figure_ever_measured(tmp_path, monkeypatch):
    """A busy re-measurement never lowers the cached figure; a faster one raises it, for later runs too."""
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    monkeypatch.setattr(peak, "_MEMO", {})
    monkeypatch.setattr(peak, "_MEASURED_AGAIN", set())
    rates = iter([5e10, 2e10, 8e10])
    monkeypatch.setattr(peak, "measure_matmul_rate", lambda dtype: next(rates))
    assert peak.cpu_peak(torch.float32)[0] == 5e10
    assert peak.cpu_peak(torch.float32, reprobe=True)[0] == 5e10  # measured 2e10 while busy: kept 5e10
    rate, source = peak.cpu_peak_beaten(torch.float32, 5e10)  # a step beat it: measured 8e10
    assert rate == 8e10 and "measured again" in source
    peak._MEMO.clear()  # a later run reads the best figure from the file
    assert peak.cpu_peak(torch.float32)[0] == 8e10


def test_real_matmul_rate_and_gpu_datasheet_peaks(monkeypatch):
    assert peak.measure_matmul_rate(torch.float32, n=64, rounds=2, calls=2) > 1e6
    sizes = []  # a dtype this CPU multiplies slowly is measured on a smaller square, within the budget
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: sizes.append(a.shape[0]) or real_mm(a, b))
    peak.measure_matmul_rate(torch.float32, budget_s=1e-9)
    assert sizes[:2] == [256, 256] and set(sizes[2:]) == {256}

    def device(name: str, gib: int) -> None:
        props = SimpleNamespace(name=name, total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device: props)

    device("NVIDIA H100 80GB HBM3", 80)
    rate, source = peak.gpu_peak(torch.device("cuda", 0), torch.bfloat16)
    assert rate == 989e12 and source.startswith("h100's datasheet dense bf16 peak")
    device("NVIDIA A100-SXM4-40GB", 40)
    assert peak.gpu_peak(torch.device("cuda", 0), torch.float32)[0] == 312e12
    device("NVIDIA H100 PCIe", 80)  # other clocks than the table's SXM figures: no reference, MFU n/a
    rate, source = peak.gpu_peak(torch.device("cuda", 0), torch.bfloat16)
    assert rate != rate and "no datasheet peak" in source
