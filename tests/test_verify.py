"""`meshtron verify`: the shrunk model keeps the architecture and layout; the command compares a layout
with one device and fails beyond its tolerance."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from meshtron.commands.verify import communication_lines, report, shrink, to_overrides, verify
from meshtron.rules.checks import check, load_config


@pytest.mark.parametrize(
    "config, overrides, world",
    [
        ("configs/llama3-70b.toml", [], 256),
        ("configs/mixtral-8x7b.toml", [], 64),
        ("configs/deepseek-moe.toml", [], 64),
        ("configs/long-context.toml", [], 4),
        (
            "configs/llama3-8b.toml",
            ["--parallel.pp=4", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved"],
            32,
        ),
    ],
)
def test_shrunk_model_keeps_architecture_and_layout(config, overrides, world):
    cfg = load_config(config, overrides)
    small = shrink(cfg, world)
    check(small, world)  # still a valid layout on as many ranks
    m, s = cfg.model, small.model
    assert (s.n_heads, s.kv_heads, s.n_experts, s.top_k, s.router, s.tie_embeddings) == (
        m.n_heads, m.kv_heads, m.n_experts, m.top_k, m.router, m.tie_embeddings,
    )  # fmt: skip
    assert (s.n_shared_experts, s.n_expert_groups, s.router_bias_rate, s.balance_loss) == (
        m.n_shared_experts, m.n_expert_groups, m.router_bias_rate, m.balance_loss,
    )  # fmt: skip
    assert small.parallel == cfg.parallel.__class__(**{**vars(cfg.parallel), "pp_layers": []})
    assert s.dim * s.n_layers < 50_000 and small.training.dtype == "fp32"
    assert load_config(None, to_overrides(small)) == small  # what the worker processes rebuild


def test_shrunk_model_trains_on_the_default_corpus_whatever_the_runs_data():
    """A mixture, validation data and evaluation are the run's own (another tokenizer, other files): the
    shrunk copy compares steps on the default corpus in bytes, and its workers rebuild it from overrides."""
    tables = '[{path = "data/web", weight = 0.7}, {path = "data/code", weight = 0.3}]'
    for data in ([f"--data.sources={tables}", "--data.val_fraction=0.01"], ["--data.val_path=data/val"]):
        cfg = load_config("configs/tiny-moe.toml", [*data, "--training.eval_every=5"])
        small = check(shrink(cfg, 2), 2)
        d = small.data
        assert (d.path, d.sources, d.val_path, d.val_fraction, d.tokenizer) == (
            "default",
            [],
            "",
            0.0,
            "byte",
        )
        assert load_config(None, to_overrides(small)) == small


def verify_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtron", "verify", *args], capture_output=True, text=True, timeout=600
    )


def test_verify_passes_a_correct_layout(workers, capsys):
    # the experts folded over dp_shard x tp (ep 4, etp 1): the counted ep bytes are the planner's formula's
    layout = [
        "--parallel.tp=2",
        "--parallel.sp=true",
        "--parallel.dp_shard=2",
        "--parallel.ep=4",
        "--parallel.etp=1",
    ]
    assert verify(load_config("configs/tiny-moe.toml", layout), 4, steps=3, pools=workers) == 0
    out = capsys.readouterr().out
    assert "meshtron verify: OK" in out and "experts" in out and "router" in out
    assert "counted/formula" in out and " ep " in out and " tp " in out


def test_verify_command_refuses_an_invalid_layout_before_running():
    out = verify_cli("--config", "configs/tiny-moe.toml", "--nproc", "4", "--parallel.ep=3")
    assert out.returncode == 2 and "use ep in [1, 2, 4]" in out.stderr


def test_verify_prints_its_report_without_the_trainers_start_up_lines():
    out = verify_cli("--config", "configs/tiny-moe.toml", "--nproc", "2", "--parallel.tp=2", "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("meshtron verify: 2 ranks vs 1") == 1 and "meshtron verify: OK" in out.stdout
    assert "backend" not in out.stdout and "building the model" not in out.stdout


def test_report_fails_beyond_tolerance_naming_the_worst_parameter():
    grads = {"layers.0.attention.wq.weight": torch.ones(4), "layers.0.moe.experts.w1": torch.ones(4)}
    ref = {"rows": [{"step": 1, "loss": 2.0}], "grads": grads}
    off = {
        "rows": [{"step": 1, "loss": 2.0}],
        "grads": {**grads, "layers.0.moe.experts.w1": 1.001 * torch.ones(4)},
    }
    lines, ok = report(off, ref, tolerance=1e-5)
    assert not ok and any(line.strip().startswith("experts") and "1.00e-03" in line for line in lines)
    assert report(off, ref, tolerance=1e-2)[1]
    lossy = {**ref, "rows": [{"step": 1, "loss": 2.001}]}
    assert not report(lossy, ref, tolerance=1e-5)[1]


def test_a_pipelines_counted_bytes_equal_its_exact_formula(workers, capsys):
    """A pipeline's formula counted a send and a receive per message each way: verify printed
    `pp ... 0.500` and OK. Its groups are exact now; a count off an exact formula is a MISMATCH."""
    assert verify(load_config("configs/demo.toml", ["--parallel.pp=2"]), 2, steps=2, pools=workers) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  pp "))
    assert row[1] == row[2] and row[3:] == ["1.000", "="]
    step = {"step": 2, "comm_bytes_by_group": {"pp": 100.0, "tp": 90.0}}
    lines, off = communication_lines(step, {"pp": 200.0, "tp": 100.0}, frozenset({"pp"}))
    assert off == ["pp"] and lines[-2].endswith("0.500  MISMATCH: the formula is exact for this group")
    assert lines[-1].endswith("0.900")  # a leading term (tp) is not held to its count


def test_verify_prices_the_context_exchange_latent_attention_runs(workers, capsys):
    """An MoE model's cp bytes had no formula (`-`), and parallel.cp_exchange = "auto" was priced as the
    keys and values while the run chose the latents (0.33 of the count). The formula now prices what the
    run sends; an MoE layer adds only its routing statistics' all-reduce."""
    cfg = load_config("configs/tiny-deepseek.toml", ["--parallel.cp=2"])
    assert verify(cfg, 2, steps=2, pools=workers) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  cp "))
    assert 1.0 <= float(row[3]) <= 1.01, row


def test_verify_shows_the_last_stages_communication_too(workers, capsys):
    """Under pp the table was rank 0's alone: DeepSeek's first layer is dense, so a pp 2 layout showed no
    expert exchange at all. The last stage's first rank has its table too, its exact groups held."""
    layout = ["--parallel.pp=2", "--parallel.ep=2", "--training.micro_batch=2"]
    assert verify(load_config("configs/tiny-deepseek.toml", layout), 4, steps=2, pools=workers) == 0
    out = capsys.readouterr().out
    first, last = out.split("on rank 0 per group")[1].split("on rank 2 per group")
    assert "\n  ep " not in first and "\n  ep " in last and "\n  pp " in last


def test_verify_does_not_hold_what_the_formula_leaves_out_as_exact(workers, capsys):
    """DualPipeV under ZeRO-3 with multi-token prediction: the numbers agree, but ZeRO-3's gathers under
    a V schedule and what MTP adds are not in the formula yet; verify exited 1 with MISMATCH on those
    groups as if they were exact. They are shown as leading terms now."""
    layout = ["--model.mtp_depth=1", "--model.n_layers=4", "--parallel.pp=2", "--parallel.ep=2"]
    layout += ["--parallel.pp_schedule=dualpipev", "--parallel.zero=3", "--training.micro_batch=1"]
    assert verify(load_config("configs/tiny-deepseek.toml", layout), 4, steps=2, pools=workers) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "\n  dp_shard " in out
