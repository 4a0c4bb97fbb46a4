"""The `meshtron` command as a user runs it: mesh, prepare-data, train (one process, --nproc, --dry-run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from meshtron.commands.dry_run import resolved
from meshtron.commands.main import main
from meshtron.config.loading import build_config, tomllib
from meshtron.plan.estimate import estimate
from meshtron.plan.hardware import table_name
from meshtron.rules.checks import load_config

ROOT = Path(__file__).resolve().parents[1]


def meshtron(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "meshtron", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_mesh_json():
    out = meshtron("mesh", "--pp", "2", "--dp-shard", "2", "--cp", "2", "--tp", "2", "--ep", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["dims"] == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 2,
        "tp": 2,
        "ep": 4,
        "cp_ulysses": 1,
        "etp": 2,
        "edp": 1,
        "world_size": 16,
    }
    assert data["groups"]["tp"][:2] == [[0, 1], [2, 3]]
    assert data["groups"]["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_mesh_text_and_picture(tmp_path):
    out = meshtron(
        "mesh",
        "--dp-replicate",
        "2",
        "--dp-shard",
        "4",
        "--tp",
        "4",
        "--gpus-per-node",
        "8",
        "--out",
        str(tmp_path / "m.png"),
    )
    assert out.returncode == 0, out.stderr
    assert "dims crossing nodes: dp_shard, dp_replicate" in out.stdout
    assert "   9     1" in out.stdout  # rank 9 sits on node 1
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_mesh_shows_hybrid_context_parallel_groups():
    """Ulysses takes consecutive cp ranks (the nearer ones), the ring one of each Ulysses group."""
    out = meshtron("mesh", "--cp", "4", "--cp-ulysses", "2", "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "cp_ulysses groups (size 2): [0, 2] [4, 6] [1, 3] [5, 7]" in out.stdout
    assert "cp_ring groups (size 2): [0, 4] [2, 6] [1, 5] [3, 7]" in out.stdout
    bad = meshtron("mesh", "--cp", "4", "--cp-ulysses", "3")
    assert bad.returncode == 2 and "cp_ulysses=3 must divide cp=4" in bad.stderr


def test_mesh_bad_layout_is_a_clear_error():
    out = meshtron("mesh", "--dp-shard", "4", "--ep", "3")
    assert out.returncode == 2
    assert "ep=3 must divide dp_shard*cp=4" in out.stderr and "Traceback" not in out.stderr


def test_context_table_and_picture(tmp_path):
    out = meshtron("context", "--ring", "3", "--out", str(tmp_path / "cp.png"))
    assert out.returncode == 0, out.stderr
    assert "ring of 3: rank r holds chunks r and 5-r of 6" in out.stdout
    assert "step 1: r0<-kv2: second half q x all kv; r1<-kv0: all q x first half kv" in out.stdout
    assert "(zigzag chunks): 6, 6, 6" in out.stdout and "(contiguous chunks): 2, 6, 10" in out.stdout
    assert (tmp_path / "cp.png").read_bytes()[:4] == b"\x89PNG"
    bad = meshtron("context", "--ring", "0")
    assert bad.returncode == 2 and "--ring=0 must be positive" in bad.stderr


def test_context_with_documents_names_the_skipped_ring_steps(tmp_path):
    out = meshtron("context", "--ring", "4", "--documents", "5,3,4,9,2,6,3", "--out", str(tmp_path / "d.png"))
    assert out.returncode == 0, out.stderr
    # Rank 3 holds positions 12-15 and 16-19 (one document, 12-20); ranks 0-2's first chunks end at 11.
    assert (
        "rank 3: step 0 (kv3) computed; step 1 (kv2) skipped; step 2 (kv1) skipped; step 3 (kv0) skipped"
        in out.stdout
    )
    assert "ring steps skipped: 7 of 16" in out.stdout
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    bad = meshtron("context", "--ring", "4", "--documents", "5,3,4")
    assert bad.returncode == 2 and "multiple of 2·ring = 8" in bad.stderr


def test_prepare_data(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n")
    out = meshtron(
        "prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "d")
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no terminal: no progress, only the summary line
    assert "2 documents from 2 files)" in out.stdout and " tokens/s)" in out.stdout
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["n_tokens"] == len(b"hello world\n") + len("héllo".encode()) + 2
    one = meshtron("prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "one"))
    assert "1 document from 1 file)" in one.stdout  # not "1 documents from 1 files"
    bad = meshtron("prepare-data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "e"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_train_reports_every_config_problem_without_traceback():
    out = meshtron(
        "train",
        "--config",
        "configs/demo.toml",
        "--model.n_heads=7",
        "--parallel.tp=2",
        "--training.dtype=fp16",
        "--nproc",
        "2",
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "n_heads=7 is not divisible by parallel.tp=2" in out.stderr
    assert "training.dtype='fp16'" in out.stderr
    assert "model.dim=256 is not divisible by model.n_heads=7" in out.stderr
    assert "4 problems" in out.stderr
    typo = meshtron("train", "--config", "configs/demo.toml", "--training.stepz=3")
    assert typo.returncode == 2 and "did you mean 'steps'?" in typo.stderr


def test_train_on_one_process(tmp_path):
    out = meshtron(
        "train",
        "--config",
        "configs/demo.toml",
        "--training.steps=3",
        "--model.n_layers=1",
        "--training.seq_len=32",
        f"--run.dir={tmp_path}",
        "--run.log_every=1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("step ") == 3 and "tok/s" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "loss.png").exists()
    # README's workflow goes on from the demo's run directory: the demo saves a checkpoint at its end.
    exported = meshtron("export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    weights, config = tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json"
    assert weights.stat().st_mode & 0o777 == config.stat().st_mode & 0o777  # the umask's, as every file
    sample = meshtron("generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "4")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr


def test_export_of_a_run_that_saved_no_checkpoint_says_how_to_save_one(tmp_path):
    out = meshtron("train", "--config", "configs/demo.toml", "--training.steps=1", "--model.n_layers=1",
                   "--training.seq_len=32", "--checkpoint.every=0", f"--run.dir={tmp_path}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    refused = meshtron("export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf"))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"the run in {tmp_path} saved no checkpoint" in refused.stderr
    assert "--checkpoint.every=N" in refused.stderr


NPROC_COMMON = [
    "--config",
    "configs/demo.toml",
    "--training.steps=3",
    "--model.n_layers=2",
    "--training.seq_len=32",
    "--training.global_batch=4",
    "--training.micro_batch=1",
]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> list[dict]:
    """The single-process run every --nproc layout is compared with, run once."""
    run_dir = tmp_path_factory.mktemp("one")
    one = meshtron("train", *NPROC_COMMON, "--run.plot=false", f"--run.dir={run_dir}")
    assert one.returncode == 0, one.stderr
    return read_metrics(run_dir)


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
        ["--parallel.dp_shard=2", "--parallel.zero=3"],
        ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=zero_bubble"],
    ],
    ids=["ddp", "zero3", "pp"],
)
def test_train_nproc_agrees_with_one_process(tmp_path, layout, one_process_run):
    many = meshtron("train", *NPROC_COMMON, *layout, f"--run.dir={tmp_path / 'many'}", "--nproc=2")
    assert many.returncode == 0, many.stderr
    rows = read_metrics(tmp_path / "many")
    env = json.loads((tmp_path / "many" / "environment.json").read_text())
    # The ranks record the command the user typed, not the launcher's rewrite of it.
    assert env["command"].startswith("meshtron train --config") and env["command"].endswith("--nproc=2")
    assert env["world_size"] == 2 and env["mesh"]["summary"] in many.stdout
    for a, b in zip(rows, one_process_run, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] <= 1e-5
        assert a["comm_bytes"] > 0 and b["comm_bytes"] == 0
    if "--parallel.pp=2" in layout:  # the measured timeline of the last step, next to its simulation
        assert (tmp_path / "many" / "pipeline-timeline.png").exists()
        assert "% measured" in many.stdout
        assert all(0 < row["pp_bubble"] < 1 for row in rows)


def test_train_nproc_with_expert_parallel_reports_expert_load(tmp_path):
    """The README's MoE command under ep 2: the console and metrics.jsonl carry each layer's expert load,
    and the run ends with the heat map of it."""
    out = meshtron(
        "train",
        "--config",
        "configs/tiny-moe.toml",
        "--training.steps=3",
        "--model.n_layers=2",
        "--training.seq_len=32",
        "--training.micro_batch=4",
        "--parallel.ep=2",
        "--model.router_bias_rate=0.01",
        f"--run.dir={tmp_path}",
        "--nproc=2",
    )
    assert out.returncode == 0, out.stderr
    assert "MoE imbalance" in out.stdout and "ep2 x edp1" in out.stdout
    rows = read_metrics(tmp_path)
    assert sorted(rows[-1]["moe"]) == ["layers.0", "layers.1"]
    assert all(layer["imbalance"] >= 1 for layer in rows[-1]["moe"].values())
    assert (tmp_path / "expert-load.png").stat().st_size > 1000


# `meshtron train --dry-run`, in process: the CPU probe is a fixed Cluster, so the numbers are exact.
DEMO = str(ROOT / "configs" / "demo.toml")
TP2_DP2 = ["--nproc", "4", "--parallel.tp=2", "--parallel.dp_shard=2"]


def test_train_dry_run_prints_config_mesh_and_prediction(fixed_cpu, nothing_starts, capsys):
    assert main(["train", "--config", DEMO, *TP2_DP2, "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(DEMO, ["--parallel.tp=2", "--parallel.dp_shard=2"])
    config, rest = out.split("# mesh")
    assert build_config(tomllib.loads(config)) == cfg  # every section and key, loadable as it is printed
    assert "world size 4: pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2" in rest
    assert "; 4 ranks per node, 1 node\n" in rest  # a CPU's ranks, not "4 GPUs per node, 1 node(s)"
    assert "tp groups (size 2): [0, 1] [2, 3]" in rest and "dp_shard groups (size 2): [0, 2] [1, 3]" in rest
    assert "# prediction for layout tp=2,pp=1,dp_shard=2,zero=3,micro_batch=4,recompute=none" in rest
    est = estimate(resolved(cfg, 4), fixed_cpu.cpu_cluster(4))
    assert f"step time          {est.step_time_s:.4g} s" in rest
    assert f"tokens/s per rank  {est.tokens_per_sec_per_gpu:,.0f}" in rest
    assert f"MFU                {100 * est.mfu:.1f}%" in rest
    assert "of 8.00 GiB" in rest and ": fits" in rest and "  optimizer " in rest and "  compute " in rest
    assert "4 gloo ranks on this CPU (" in rest and "fp32 matmul 50.0 GFLOP/s per rank" in rest
    assert "8.0 GiB of host memory per rank" in rest and "loopback 5.00 GB/s" in rest and "NVLink" not in rest
    environment = rest.split("# environment")[1]  # what the run would write to environment.json
    assert "\nworld_size: 4\n" in environment and "\ntorch: " in environment and "\ngit: " in environment
    assert '"tp": {"count": 2, "first": [0, 1]}' in environment and "\ncommand: " in environment
    assert list(nothing_starts.iterdir()) == []  # no run directory, no checkpoint, no data cache


def test_train_dry_run_resolves_dp_shard_and_keeps_it_in_the_config(fixed_cpu, nothing_starts, capsys):
    assert main(["train", "--config", DEMO, "--nproc", "4", "--parallel.tp=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard = -1  # 2 on 4 ranks" in out and "dp_shard=2" in out


def test_train_dry_run_refuses_an_invalid_layout_as_train_does(fixed_cpu, nothing_starts, capsys):
    bad = ["train", "--config", DEMO, "--nproc", "4", "--parallel.tp=3", "--parallel.dp_shard=2"]
    assert main([*bad, "--dry-run"]) == 2
    dry = capsys.readouterr()
    assert main(bad) == 2  # refused by check() before any launch, as the dry run was
    assert dry.err == capsys.readouterr().err and "meshtron: error: invalid config" in dry.err
    assert "= 6 but the world size is 4" in dry.err and "not divisible by parallel.tp=3" in dry.err
    assert dry.out == ""  # nothing printed before the refusal
    assert list(nothing_starts.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "gib", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", 79.1, "h100"),
        ("NVIDIA A100-SXM4-80GB", 79.1, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
        ("NVIDIA H200", 139.8, "h200"),
        ("NVIDIA H800", 79.1, "h800"),
        ("NVIDIA B200", 178.4, "b200"),
        ("NVIDIA H100 PCIe", 79.1, None),  # the table's figures are SXM boards'
        ("NVIDIA GH200 480GB", 94.5, None),
        ("Tesla V100-SXM2-16GB", 15.8, None),
    ],
)
def test_dry_run_maps_cuda_device_names_to_the_planner_table(name, gib, entry):
    assert table_name(name, int(gib * 2**30)) == entry


def test_train_dry_run_on_a_gpu(monkeypatch, nothing_starts, capsys):
    """A known GPU gets a prediction against the memory it reports; an unknown one, or fp32 (the table has
    no fp32 rate), is named and the prediction skipped."""
    device = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * 2**30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    assert main(["train", "--config", DEMO, *TP2_DP2, "--training.dtype=bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "hardware: NVIDIA H100 80GB HBM3, the planner's h100" in out
    assert "tokens/s per GPU" in out and "of 79.10 GiB" in out
    assert main(["train", "--config", DEMO, *TP2_DP2, "--dry-run"]) == 0
    assert "has no fp32 matmul rate" in capsys.readouterr().out
    device.name = "NVIDIA GH200 480GB"
    assert main(["train", "--config", DEMO, *TP2_DP2, "--training.dtype=bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "GPU 'NVIDIA GH200 480GB' is not in the planner's table" in out and "step time" not in out
    assert "world size 4:" in out  # the config and the mesh are printed all the same


def test_missing_data_is_refused_before_any_rank_starts(tmp_path):
    """Issue 37.4: the data is checked like the config, before the launcher starts ranks."""
    out = meshtron("train", *NPROC_COMMON, "--nproc", "2", f"--data.path={tmp_path / 'nowhere'}",
                   f"--run.dir={tmp_path / 'run'}")  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no prepared dataset at {tmp_path / 'nowhere'}" in out.stderr
    assert "gloo backend" not in out.stdout  # no rank started
    assert not (tmp_path / "run").exists()


def test_a_failing_rank_ends_the_launch_with_its_own_message(tmp_path):
    """A problem only ranks can find (here an unwritable run directory: its parent is a file) ends the
    launch with the first rank's message, without the launcher's report of exit codes."""
    (tmp_path / "afile").touch()
    out = meshtron("train", *NPROC_COMMON, "--nproc", "2", f"--run.dir={tmp_path / 'afile' / 'run'}")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("meshtron: training failed: rank 0: ") and "is not writable" in last
    assert "ChildFailedError" not in out.stderr and "Root Cause" not in out.stderr


def test_help_describes_the_commands_and_usage_names_the_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "meshtron trains Llama-family models" in out and "This module" not in out
    for command in ("train", "verify", "plan", "mesh", "schedule", "context", "prepare-data", "export"):
        assert f"meshtron {command}" in out
    for command, overrides in (
        ("train", "--section.key"),
        ("verify", "--section.key"),
        ("plan", "--model.key"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        usage = capsys.readouterr().out.split("\n\n")[0]
        assert usage.startswith(f"usage: meshtron {command} ") and usage.endswith(f"[{overrides}=value ...]")
    with pytest.raises(SystemExit):
        main(["mesh", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--pp PP pipeline stages",
        "--dp-shard DP_SHARD data-parallel ranks",
        "--tp TP tensor parallel",
    ):
        assert flag in out


@pytest.mark.parametrize(
    "given, dtype",
    [("fp32", "float32"), ("bf16", "bfloat16"), ("float32", "float32"), ("bfloat16", "bfloat16")],
)
def test_export_dtype_takes_the_configs_spelling_and_torchs(given, dtype):
    from meshtron.commands.main import build_parser

    args = build_parser().parse_args(["export", "--checkpoint", "c", "--out", "o", "--dtype", given])
    assert args.dtype == dtype


@pytest.mark.parametrize(
    "argv, typo, nearest",
    [
        (["train", "--config", "configs/demo.toml"], "--nprocs", "--nproc"),
        (["verify", "--config", "configs/demo.toml", "--nproc", "2"], "--tolerence=1e-3", "--tolerance"),
        (
            ["plan", "--gpus", "8", "--gpu", "h100", "--seq-len", "64", "--global-batch", "8"],
            "--layuot",
            "--layout",
        ),
        (["mesh"], "--tpp", "--tp"),
        (["schedule", "--pp", "2", "--microbatches", "4"], "--scheduel", "--schedule"),
        (["context", "--ring", "2"], "--documets", "--documents"),
        (["export", "--checkpoint", "c", "--out", "o"], "--max-shard-gib", "--max-shard-gb"),
        (["generate", "--checkpoint", "c", "--prompt", "x"], "--temprature", "--temperature"),
        (["prepare-data", "x", "--out", "o"], "--tokeniser", "--tokenizer"),
    ],
)
def test_an_unknown_flag_gets_the_nearest_of_its_command(capsys, argv, typo, nearest):
    with pytest.raises(SystemExit) as stop:
        main([*argv, typo, "2"])
    assert stop.value.code == 2
    assert f"unknown flag {typo.split('=')[0]} (did you mean {nearest}?)" in capsys.readouterr().err


def test_a_launched_run_notes_the_keys_over_its_preset_once(tmp_path):
    """The launcher says which keys won over the preset; the ranks it starts do not say it again."""
    preset = ["--model.name=tiny", "--model.n_layers=3", "--model.vocab_size=4096"]  # the demo's data
    out = meshtron("train", *NPROC_COMMON, *preset, "--parallel.dp_shard=2", "--run.plot=false",
                   f"--run.dir={tmp_path}", "--nproc=2")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("meshtron: note: model.name='tiny' (a preset, named on the command line): ") == 1
    assert "n_layers=3 (command line) in place of its 2" in out.stdout


QWEN3_235B = [f"--model.{k}" for k in ("dim=4096", "n_layers=94", "n_heads=64", "n_kv_heads=4", "head_dim=128",
              "ffn_dim=12288", "vocab_size=151936", "n_experts=128", "top_k=8", "moe_ffn_dim=1536")]  # fmt: skip


def test_plan_prices_what_op_recompute_keeps_of_the_dispatch():
    """`--training.op_recompute_dispatch` reaches the planner: keeping what the expert dispatch delivered
    costs memory, sending it again in backward costs time."""
    layout = (
        "tp=2,pp=8,vpp=4,pp_schedule=interleaved,ep=32,etp=1,dp_shard=16,zero=1,micro_batch=1,recompute=op"
    )
    plans = {}
    for keep in ("keep", "rerun"):
        out = meshtron("plan", "--gpus", "256", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "8192",
                       "--layout", layout, f"--training.op_recompute_dispatch={keep}", "--json", "--top=1",
                       *QWEN3_235B)  # fmt: skip
        assert out.returncode == 0, out.stderr
        plans[keep] = json.loads(out.stdout)[0]
    assert plans["keep"]["memory_bytes_per_gpu"] > plans["rerun"]["memory_bytes_per_gpu"]
    assert plans["keep"]["step_time_s"] < plans["rerun"]["step_time_s"]


def test_plan_takes_megatrons_folded_moe_layout():
    """Qwen3-235B-A22B in Megatron-Core's published layout (attention tp 2 x dp 16, experts ep 32 x etp 1
    over the same ranks, pp 8 x vpp 4) on 256 H100s, DeepEP's dispatch: planned, and fitting."""
    layout = "tp=2,pp=8,vpp=4,pp_schedule=interleaved,ep=32,etp=1,dp_shard=16,zero=1,micro_batch=1"
    out = meshtron("plan", "--gpus", "256", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "8192",
                   "--dtype", "fp8", "--layout", layout, "--parallel.ep_dispatch=hierarchical", "--json",
                   *QWEN3_235B)  # fmt: skip
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)[0]
    assert (best["layout"]["ep"], best["layout"]["etp"], best["layout"]["tp"]) == (32, 1, 2)
    assert best["memory_bytes_per_gpu"] < 80 * 2**30
