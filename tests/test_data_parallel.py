"""Data parallelism (DDP, ZeRO-1/2/3, HSDP) against the single-device run: losses over 10 steps and
step-1 gradients, plus memory held per rank, bytes communicated, and overlap with backward.

Tolerances (fp32): loss relative difference <= 1e-5 at every step; per-parameter gradient relative L2
error <= 1e-5."""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtron.testing.parity import assert_parity, reference, run_layout, train_rows, trainer_for
from meshtron.testing.tiny import MOE, TINY

LAYOUTS = {
    # name: (world, parallel overrides)
    "ddp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"]),
    "ddp4": (4, ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"]),
    "zero1_2": (2, ["--parallel.dp_shard=2", "--parallel.zero=1"]),
    "zero1_4": (4, ["--parallel.dp_shard=4", "--parallel.zero=1"]),
    "zero2_2": (2, ["--parallel.dp_shard=2", "--parallel.zero=2"]),
    "zero2_4": (4, ["--parallel.dp_shard=4", "--parallel.zero=2"]),
    "zero3_2": (2, ["--parallel.dp_shard=2", "--parallel.zero=3"]),
    "zero3_4": (4, ["--parallel.dp_shard=4", "--parallel.zero=3"]),
    "hsdp2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=3"]),
    "hybrid_zero2_2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=2"]),
}


@pytest.mark.parametrize("accumulate", [False, True], ids=["one_micro_batch", "accumulation"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_single_device(workers, layout, accumulate):
    world, parallel = LAYOUTS[layout]
    per_rank = 8 // world
    micro = 1 if accumulate else per_rank
    results = workers(world).run(run_layout, [*TINY, *parallel, f"--training.micro_batch={micro}"])
    assert_parity(results[0], reference(workers(1), []))
    for other in results[1:]:  # every rank holds the same whole gradients and saw the same losses
        for name, grad in other["grads"].items():
            assert torch.equal(grad, results[0]["grads"][name]), name


def test_moe_under_fsdp(workers):
    results = workers(2).run(
        run_layout, [*TINY, *MOE, "--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=2"]
    )
    assert_parity(results[0], reference(workers(1), MOE, micro_batch=2))


def test_torch_fully_shard_matches_too(workers):
    results = workers(2).run(
        run_layout,
        [
            *TINY,
            "--parallel.dp_shard=2",
            "--parallel.zero=3",
            "--parallel.fsdp_impl=torch",
            "--training.micro_batch=4",
        ],
    )
    assert_parity(results[0], reference(workers(1), []))


@pytest.mark.parametrize(
    "layout, expected_bytes_per_param",
    [
        # fp32 Adam (REFERENCE.md): 4 bytes params + 4 grads + 8 optimizer state, sharded per ZeRO stage
        ("ddp4", lambda n: (4, 4, 8)),
        ("zero1_4", lambda n: (4, 4, 8 / n)),
        ("zero2_4", lambda n: (4, 4 / n, 8 / n)),
        ("zero3_4", lambda n: (4 / n, 4 / n, 8 / n)),
        ("zero3_2", lambda n: (4 / n, 4 / n, 8 / n)),
    ],
)
def test_memory_matches_zero_table(workers, layout, expected_bytes_per_param):
    world, parallel = LAYOUTS[layout]
    results = workers(world).run(run_layout, [*TINY, *parallel, f"--training.micro_batch={8 // world}"])
    for r in results:
        n_params = r["n_params"]
        expected = [b * n_params for b in expected_bytes_per_param(world)]
        held = r["state_bytes"]
        measured = [held["params"], held["grads"], held["optimizer"]]
        print(f"{layout}: measured {measured} vs ZeRO table {expected}")
        for kind, got, want in zip(("params", "grads", "optimizer"), measured, expected, strict=True):
            assert abs(got - want) <= 0.05 * want, f"{kind}: {got} vs {want}"


@pytest.mark.parametrize(
    "layout, volume",
    [("ddp2", 2), ("ddp4", 2), ("zero1_4", 2), ("zero2_4", 2), ("zero3_2", 3), ("zero3_4", 3)],
)
def test_comm_bytes_match_theory(workers, layout, volume):
    world, parallel = LAYOUTS[layout]
    results = workers(world).run(run_layout, [*TINY, *parallel, f"--training.micro_batch={8 // world}"])
    r = results[0]
    expected = volume * 4 * r["n_params"] * (world - 1) / world
    for row in r["rows"][1:]:  # step 1 also carries DDP's initial broadcast of the weights
        assert abs(row["comm_bytes"] - expected) <= 0.02 * expected, (row["comm_bytes"], expected)


def test_hsdp_comm_per_group(workers):
    world, parallel = LAYOUTS["hsdp2x2"]
    r = workers(world).run(run_layout, [*TINY, *parallel, "--training.micro_batch=2"])[0]
    psi = 4 * r["n_params"]
    for row in r["rows"]:
        by_group = row["comm_bytes_by_group"]
        assert by_group["dp_shard"] == pytest.approx(3 * psi / 2, rel=0.02)  # AG + AG + RS over 2 shards
        assert by_group["dp_replicate"] == pytest.approx(2 * (psi / 2) / 2, rel=0.02)  # AR of a half over 2


def overlap_probe(overrides: list[str]) -> list[int]:
    trainer = trainer_for(overrides)
    trainer.compute_gradients()
    return trainer.engine.launch_log


@pytest.mark.parametrize(
    "parallel",
    [["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.dp_shard=2", "--parallel.zero=2"]],
    ids=["ddp", "zero2"],
)
def test_first_bucket_launches_before_backward_ends(workers, parallel):
    logs = workers(2).run(
        overlap_probe, [*TINY, *parallel, "--parallel.bucket_mb=0.05", "--training.micro_batch=4"]
    )
    for log in logs:
        assert len(log) > 3  # several buckets
        # When the first bucket's collective started, gradients of other parameters were still to come.
        assert log[0] > 0
        assert log[-1] == 0


def test_checkpoint_written_by_zero3_resumes_on_other_layouts(workers, tmp_path):
    """Save under ZeRO-3 on 2 ranks; resume under ZeRO-1 on 4 ranks and on a single device: each continues
    exactly as the uninterrupted run does (the checkpoint holds row shards of logical tensors)."""
    base = [*TINY, "--training.steps=6", "--checkpoint.every=3", "--checkpoint.keep=1"]
    straight = workers(2).run(
        train_rows,
        [*base, "--parallel.dp_shard=2", "--training.micro_batch=4", f"--run.dir={tmp_path / 'straight'}"],
    )[0]
    first = f"--run.dir={tmp_path / 'first'}"
    workers(2).run(
        train_rows, [*base, "--parallel.dp_shard=2", "--training.micro_batch=4", "--training.steps=3", first]
    )
    for name, world, layout in [
        ("zero1x4", 4, ["--parallel.dp_shard=4", "--parallel.zero=1"]),
        ("single", 1, ["--parallel.dp_shard=1"]),
    ]:
        resumed_dir = tmp_path / name
        resumed_dir.mkdir()
        shutil.copytree(tmp_path / "first" / "checkpoints", resumed_dir / "checkpoints")
        rows = workers(world).run(
            train_rows,
            [
                *base,
                *layout,
                f"--training.micro_batch={8 // world}",
                "--checkpoint.resume=true",
                f"--run.dir={resumed_dir}",
            ],
        )[0]
        assert [r["step"] for r in rows] == [4, 5, 6]
        for got, want in zip(rows, straight[3:], strict=True):
            assert abs(got["loss"] - want["loss"]) / want["loss"] <= 1e-5, (name, got["loss"], want["loss"])


def test_fsdp_bf16_mixed_precision_tracks_fp32(workers):
    fp32 = workers(2).run(
        train_rows, [*TINY, "--parallel.dp_shard=2", "--training.micro_batch=4", "--training.steps=5"]
    )[0]
    bf16 = workers(2).run(
        train_rows,
        [
            *TINY,
            "--parallel.dp_shard=2",
            "--training.micro_batch=4",
            "--training.steps=5",
            "--training.dtype=bf16",
        ],
    )[0]
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.02
    # Gathered in bf16 (half the bytes of fp32), reduce-scattered in fp32.
    psi = 158016
    assert bf16[1]["comm_bytes"] == pytest.approx((2 * 2 * psi + 4 * psi) / 2, rel=0.02)


@pytest.mark.parametrize(
    "parallel",
    [["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.dp_shard=2", "--parallel.zero=2"]],
    ids=["ddp", "zero2"],
)
def test_bf16_gradient_reduction_halves_the_bytes(workers, parallel):
    common = [*TINY, *parallel, "--training.micro_batch=4", "--training.steps=4"]
    fp32 = workers(2).run(train_rows, common)[0]
    bf16 = workers(2).run(train_rows, [*common, "--parallel.reduce_dtype=bf16"])[0]
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.01
    grads = bf16[-1]["comm_bytes_by_group"]
    reduce_group = "dp" if "dp_replicate=2" in parallel[0] else "dp_shard"
    full = fp32[-1]["comm_bytes_by_group"][reduce_group]
    # DDP: the whole all-reduce halves; ZeRO-2: only the reduce-scatter half (the all-gather stays fp32).
    expected = full / 2 if reduce_group == "dp" else full * 3 / 4
    assert grads[reduce_group] == pytest.approx(expected, rel=0.02)
