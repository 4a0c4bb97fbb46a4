"""Issue 45.5: a layout the planner says cannot fit in memory is refused before any rank allocates, with
the layouts (or --nproc) that would fit; `--run.memory_check=false` starts it anyway."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch

from meshtron.commands import memory_check
from meshtron.commands.dry_run import resolved
from meshtron.commands.main import main
from meshtron.commands.memory_check import MARGIN, rank_counts, too_big
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.hardware import GiB, accelerator
from meshtron.probe.cluster import run_cluster
from meshtron.rules.checks import check, load_config
from meshtron.utils.resident import host_memory_bytes

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.toml")
LLAMA_8B = ["--model.name=llama3-8b", "--training.seq_len=128"]


@pytest.fixture
def llama_8b(tmp_path) -> str:
    """demo.toml's run with Llama 3 8B's architecture (a file: the preset's keys, not demo.toml's)."""
    path = tmp_path / "llama8b.toml"
    path.write_text(
        '[model]\nname = "llama3-8b"\n[training]\nsteps = 3\nglobal_batch = 16\nmicro_batch = 4\n'
        'seq_len = 128\ndtype = "fp32"\n[data]\ntokenizer = "bpe"\n[run]\ndir = "run"\n'
    )
    return str(path)


def test_llama_8b_on_a_cpu_rank_is_refused_by_the_dry_run_and_the_run(
    fixed_cpu, nothing_starts, llama_8b, capsys
):
    cfg = resolved(load_config(llama_8b, []), 1)
    needed = estimate(cfg, fixed_cpu.cpu_cluster(1)).memory_bytes_per_gpu
    assert needed > MARGIN * 8 * GiB  # the premise: far more than the fixed CPU's 8 GiB
    assert main(["train", "--config", llama_8b, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and out.rstrip().endswith(
        "dry run: a real run would be refused (below); nothing was started"
    )
    assert f"this layout needs {needed / GiB:,.1f} GiB per rank" in err and "is 8.0 GiB each" in err
    assert f"({needed / (8 * GiB):.1f}x; refused above 1.25x" in err and "--run.memory_check=false" in err
    assert "No layout fits on 1 rank" in err and "smaller model" in err and "Traceback" not in err
    # The run itself (against this machine's RAM) is refused the same way, before anything starts.
    assert main(["train", "--config", llama_8b]) == 2
    assert "GiB per rank by the planner's count" in capsys.readouterr().err
    # The override: the dry run passes (the prediction still says it does not fit); the run would start.
    assert main(["train", "--config", llama_8b, "--run.memory_check=false", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and out.rstrip().endswith(
        "dry run: the config is valid; nothing was started"
    )
    with pytest.raises(AssertionError, match="started something"):
        main(["train", "--config", llama_8b, "--run.memory_check=false"])


def test_refused_only_beyond_the_margin():
    """1.2x what a rank has starts (the planner is within 10%, the allocator decides); 1.3x is refused."""
    cfg = resolved(load_config(DEMO, []), 1)
    cluster = Cluster(accelerator("h100"), 1, "bf16")
    needed = estimate(cfg, cluster).memory_bytes_per_gpu
    for ratio, refused in [(1.0, False), (1.2, False), (1.3, True)]:
        gpu = dataclasses.replace(cluster.gpu, memory_bytes=int(needed / ratio))
        assert (too_big(cfg, 1, dataclasses.replace(cluster, gpu=gpu)) is not None) is refused, ratio


def test_on_one_gpu_the_refusal_names_the_nproc_and_layouts_that_fit(monkeypatch, nothing_starts, capsys):
    """Llama 3 8B at 8k tokens on one 80 GB GPU: the refusal lists --nproc and overrides; each listed
    layout passes the trainer's checks and fits by the planner's count on that many GPUs."""
    device = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    config = str(ROOT / "configs" / "llama3-8b.toml")
    assert main(["train", "--config", config, "--parallel.dp_shard=1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    listed = err.split("choose): ")[1].split(". To start it anyway")[0].split("; ")
    assert 1 <= len(listed) <= memory_check.LISTED
    for item in listed:
        words = shlex.split(item.rsplit(" (", 1)[0])
        assert words[0] == "--nproc"
        nproc, overrides = int(words[1]), words[2:]
        assert nproc > 1
        cfg = load_config(config, ["--parallel.dp_shard=-1", *overrides])
        check(cfg, nproc)
        gpu = dataclasses.replace(accelerator("h100"), memory_bytes=device.total_memory)
        assert estimate(resolved(cfg, nproc), Cluster(gpu, nproc, "bf16")).fits, item


def test_the_check_measures_nothing_and_shares_the_host_among_its_ranks(monkeypatch):
    """No CPU probe (it takes seconds): the host's RAM over the ranks on it, this process as a rank."""
    monkeypatch.setitem(sys.modules, "meshtron.probe.hardware", None)  # importing it would fail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(DEMO, [])
    cluster = run_cluster(cfg, 4)
    assert cluster.gpus == 4 and cluster.gpu.memory_bytes == host_memory_bytes() // 4
    assert too_big(resolved(cfg, 4), 4) is None  # the demo fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 of the 4 ranks on this host
    assert run_cluster(cfg, 4).gpu.memory_bytes == host_memory_bytes() // 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    big = resolved(load_config(None, LLAMA_8B), 1)
    if estimate(big, run_cluster(big, 1)).memory_bytes_per_gpu <= MARGIN * host_memory_bytes():
        pytest.skip("this host holds Llama 3 8B's training state")
    assert f"and this host has {host_memory_bytes() / GiB:,.1f} GiB (" in too_big(big, 1)


def test_the_worlds_searched():
    """GPUs bring their memory (more of them); a CPU's ranks share one RAM (fewer of them)."""
    assert rank_counts(Cluster(accelerator("h100"), 2)) == [2, 4, 8, 16]
    cpu = dataclasses.replace(accelerator("h100"), name="cpu", gpus_per_node=4)
    assert rank_counts(Cluster(cpu, 4)) == [4, 2, 1]
    assert rank_counts(Cluster(dataclasses.replace(cpu, gpus_per_node=6), 6)) == [6, 3]


def test_an_moe_that_does_not_fit_says_where_its_memory_goes():
    """Mixtral 8x7B on 8 GPUs of 40 GB at ep 1: the refusal lists the planner's parts (largest first,
    summing to what it needs) and the routed experts' share of the state, which a larger ep would spread."""
    cfg = resolved(
        load_config(
            str(ROOT / "configs" / "mixtral-8x7b.toml"),
            [
                "--parallel.ep=1",
                "--parallel.tp=1",
                "--parallel.pp=1",
                "--parallel.dp_shard=-1",
                "--parallel.zero=1",
                "--training.micro_batch=1",
            ],
        ),
        8,
    )
    gpu = dataclasses.replace(accelerator("h100"), memory_bytes=40 * GiB)
    cluster = Cluster(gpu, 8, "bf16")
    est = estimate(cfg, cluster)
    why = too_big(cfg, 8, cluster)
    assert why is not None
    parts = why.split("Where it goes (GiB): ")[1].split("; the routed experts'")[0].split(", ")
    listed = {name: float(value.replace(",", "")) for name, value in (p.rsplit(" ", 1) for p in parts)}
    assert list(listed.values()) == sorted(listed.values(), reverse=True)
    assert sum(listed.values()) == pytest.approx(est.memory_bytes_per_gpu / GiB, abs=0.05 * len(listed))
    experts = float(why.split("state are ")[1].split(" GiB")[0].replace(",", ""))
    state = listed["params"] + listed.get("grads", 0) + listed["optimizer"]
    assert 0.5 * state < experts < state  # Mixtral's routed experts hold most of its parameters
