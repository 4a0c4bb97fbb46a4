"""Data parallelism (DDP, ZeRO-1/2/3, HSDP) against the single-device run: losses over 6 steps and
step-1 gradients, plus memory held per rank, bytes communicated, and overlap with backward.

Tolerances (fp32): loss relative difference <= 1e-5 at every step; per-parameter gradient relative L2
error <= 1e-5."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from meshtron.models.llama import build_model
from meshtron.plan.comm import exact_groups
from meshtron.rules.checks import load_config
from meshtron.testing.fuzz import check_layout
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    reference,
    ring,
    run_layout,
    train_rows,
    trainer_for,
)
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
    # Many buckets: each reuses a staging buffer two buckets after another took it (engines/staging.py).
    "zero1_4_buckets": (4, ["--parallel.dp_shard=4", "--parallel.zero=1", "--parallel.bucket_mb=0.02"]),
    "zero2_2x2_buckets": (4, ["--parallel.dp_replicate=2", "--parallel.zero=2", "--parallel.bucket_mb=0.02"]),
    # With replicas ZeRO-1 packs its gradients rank-major and reduce-scatters them (engines/zero.py).
    "hybrid_zero1_2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=1"]),
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


def test_torch_fully_shard_hsdp_moves_the_bytes_of_meshtrons_units(workers):
    """FSDP2 as HSDP (2 replicas of 2 shards), two micro-batches a step: its all-gathers and reduce-
    scatters counted through its custom-collective hooks, its replicas' all-reduce once per step (told
    the last micro-batch), each group's bytes equal to step_bytes' exact formula for meshtron's units."""
    layout = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=3"]
    layout += ["--parallel.fsdp_impl=torch", "--training.micro_batch=1"]
    assert {"dp_shard", "dp_replicate"} <= exact_groups(load_config(None, [*TINY, *layout]))
    check_layout(workers, layout, 4)


def test_torch_fully_shard_under_sequence_parallel_sums_the_norms_over_tp(workers):
    """FSDP2 with tp 2 + sp inside: the norms (whole weights that see 1/tp of the tokens) need their
    gradients summed over tp. fully_shard replaces the parameters that tensor parallel's hooks were on,
    so the norms came out 40% off (fuzz seed 7272, --wide, layout 3) until the engine summed them."""
    layout = ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3"]
    layout += ["--parallel.fsdp_impl=torch", "--training.micro_batch=1", "--model.n_kv_heads=4"]
    check_layout(workers, layout, 4)


# A vocabulary (510) that 4 ranks do not divide: the embedding's and the head's row blocks are padded,
# and the last rank owns fewer rows than the others.
UNEVEN = ["--model.vocab_size=510"]
SHARDED = {  # name: (world, zero stage, model overrides)
    "zero1_4": (4, 1, []),
    "zero2_4": (4, 2, []),
    "zero3_2": (2, 3, []),
    "zero3_4": (4, 3, []),
    "zero1_4_uneven": (4, 1, UNEVEN),
    "zero2_4_uneven": (4, 2, UNEVEN),
    "zero3_4_uneven": (4, 3, UNEVEN),
}


def parameter_shapes(model: list[str]) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in build_model(load_config(None, [*TINY, *model]).model).parameters()]


def row_block_elements(model: list[str], n: int, rank: int | None = None) -> int:
    """Elements of every parameter's dim-0 row block on one of n ranks: ceil(d0/n) rows each (padding
    included), or, given `rank`, only the rows that rank really owns (docs/theory.md#memory-per-zero-stage)."""
    total = 0
    for d0, *rest in parameter_shapes(model):
        rows = -(-d0 // n)
        if rank is not None:
            rows = max(0, min(rows, d0 - rank * rows))
        total += rows * math.prod(rest)
    return total


_RUNS: dict[tuple[str, ...], list[dict]] = {}


def layout_run(workers, world: int, overrides: list[str]) -> list[dict]:
    """`run_layout` on every rank, once per layout in this session: the memory and the communication
    tests read the same run."""
    key = (str(world), *overrides)
    if key not in _RUNS:
        _RUNS[key] = workers(world).run(run_layout, [*TINY, *overrides])
    return _RUNS[key]


def sharded_run(workers, name: str) -> tuple[int, int, list[str], list[dict]]:
    world, zero, model = SHARDED[name]
    parallel = [
        f"--parallel.dp_shard={world}",
        f"--parallel.zero={zero}",
        f"--training.micro_batch={8 // world}",
    ]
    return world, zero, model, layout_run(workers, world, [*model, *parallel])


def test_ddp_memory_is_whole_on_every_rank(workers):
    results = layout_run(workers, 4, [*LAYOUTS["ddp4"][1], "--training.micro_batch=2"])
    psi = sum(math.prod(s) for s in parameter_shapes([]))
    for r in results:
        assert r["state_bytes"] == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}


@pytest.mark.parametrize("name", list(SHARDED))
def test_memory_matches_zero_table(workers, name):
    """fp32 Adam: 4 bytes of parameters, 4 of gradients and 8 of moments per parameter, of which ZeRO-1
    shards the moments, ZeRO-2 the gradients too and ZeRO-3 everything, as dim-0 row blocks: padded
    where the collectives need equal blocks, the rank's own rows where AdamW steps them (ZeRO-1/2)."""
    world, zero, model, results = sharded_run(workers, name)
    psi, block = sum(math.prod(s) for s in parameter_shapes(model)), row_block_elements(model, world)
    for rank, r in enumerate(results):
        owned = row_block_elements(model, world, rank)
        expected = {
            1: (4 * psi, 4 * psi, 8 * owned),
            2: (4 * psi, 4 * block, 8 * owned),
            3: (4 * block, 4 * block, 8 * block),
        }[zero]
        held = r["state_bytes"]
        assert (held["params"], held["grads"], held["optimizer"]) == expected, (rank, held, expected)


# Besides the gradients and parameters, every step all-reduces the loss (one fp32 number) over dp, and a
# sharded engine the clipping norm's two partial sums (float64) over dp_shard.
LOSS_BYTES, NORM_BYTES = 4, 16


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_comm_bytes_match_theory(workers, world):
    """Per step DDP all-reduces every gradient: twice the fp32 model's bytes, times (n-1)/n."""
    results = layout_run(workers, world, [*LAYOUTS[f"ddp{world}"][1], f"--training.micro_batch={8 // world}"])
    psi = sum(math.prod(s) for s in parameter_shapes([]))
    for row in results[0]["rows"][1:]:  # step 1 also carries the initial broadcast of the weights
        assert row["comm_bytes"] == (2 * 4 * psi + 2 * LOSS_BYTES) * ring(world)


@pytest.mark.parametrize(
    "name", ["zero1_4", "zero2_4", "zero3_2", "zero3_4", "zero1_4_uneven", "zero3_4_uneven"]
)
def test_sharded_comm_bytes_match_theory(workers, name):
    """Per step ZeRO-1/2 reduce-scatter every gradient and all-gather the updated parameters, ZeRO-3
    all-gathers in forward and again in backward and reduce-scatters: 2 or 3 times the fp32 bytes of the
    padded flat buffers the collectives move, times (n-1)/n. (On gloo ZeRO-1 all-reduces its whole
    gradients in place, which is what gloo's reduce-scatter does, and is counted as that reduce-scatter.)"""
    world, zero, model, results = sharded_run(workers, name)
    flat = world * row_block_elements(model, world)
    volume = 3 if zero == 3 else 2
    for row in results[0]["rows"]:
        assert row["comm_bytes"] == (volume * 4 * flat + 2 * LOSS_BYTES + 2 * NORM_BYTES) * ring(world)


def test_hsdp_comm_per_group(workers):
    """ZeRO-3's volume over the 2 shards, then an all-reduce of the half-size gradient shard over the 2
    replicas; the loss goes over all 4 data-parallel ranks."""
    world, parallel = LAYOUTS["hsdp2x2"]
    r = workers(world).run(run_layout, [*TINY, *parallel, "--training.micro_batch=2"])[0]
    flat_bytes = 4 * 2 * row_block_elements([], 2)
    for row in r["rows"]:
        assert row["comm_bytes_by_group"] == {
            "dp_shard": (3 * flat_bytes + 2 * NORM_BYTES) * ring(2),
            "dp_replicate": 2 * (flat_bytes / 2) * ring(2),
            "dp": 2 * LOSS_BYTES * ring(4),
        }


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


def gather_probe(overrides: list[str]) -> dict:
    trainer = trainer_for(overrides)
    trainer.step(0)
    engine = trainer.engine
    in_flight = [unit.pending is not None for unit in engine.units]
    trainer.compute_gradients()
    return {"in_flight": in_flight, "log": engine.gather_log, "left": [u.pending for u in engine.units]}


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_param_gather_overlaps_next_forward(workers, zero):
    """After the step two units' all-gathers are in flight and the rest wait; when forward reaches a unit,
    the gathers of the two after it have started (parity with the gathers finished there: above)."""
    layers = [
        "--model.n_layers=4",
        "--parallel.dp_shard=2",
        f"--parallel.zero={zero}",
        "--training.micro_batch=4",
    ]
    results = workers(2).run(gather_probe, [*TINY, *layers])
    for r in results:
        units = len(r["in_flight"])
        assert units == 5  # the root's parameters and each block's
        assert r["in_flight"] == [True, True] + [False] * (units - 2)
        assert r["log"] == [min(i + 3, units) for i in range(units)]
        assert r["left"] == [None] * units


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
        assert_losses_match(rows, straight[3:])


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
    # Gathered in bf16 (half the bytes of fp32) in forward and backward, reduce-scattered in fp32.
    psi = sum(math.prod(s) for s in parameter_shapes([]))
    expected = (2 * 2 * psi + 4 * psi + 2 * NORM_BYTES + 2 * LOSS_BYTES) * ring(2)
    assert [row["comm_bytes"] for row in bf16] == [expected] * 5


@pytest.mark.parametrize(
    "parallel",
    [
        ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
        ["--parallel.dp_shard=2", "--parallel.zero=1"],
        ["--parallel.dp_shard=2", "--parallel.zero=2"],
    ],
    ids=["ddp", "zero1", "zero2"],
)
def test_bf16_gradient_reduction_halves_the_bytes(workers, parallel):
    common = [*TINY, *parallel, "--training.micro_batch=4", "--training.steps=4"]
    fp32 = workers(2).run(train_rows, common)[0]
    bf16 = workers(2).run(train_rows, [*common, "--parallel.reduce_dtype=bf16"])[0]
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.01
    psi = sum(math.prod(s) for s in parameter_shapes([]))
    for row, grad_bytes in ((fp32[-1], 4), (bf16[-1], 2)):
        by_group = row["comm_bytes_by_group"]
        if "dp_replicate=2" in parallel[0]:  # DDP: the whole all-reduce narrows (the loss shares its group)
            assert by_group["dp"] == (2 * grad_bytes * psi + 2 * LOSS_BYTES) * ring(2)
        else:  # ZeRO-1/2: only the reduce-scatter narrows; the updated parameters are gathered in fp32
            assert by_group["dp_shard"] == (grad_bytes * psi + 4 * psi + 2 * NORM_BYTES) * ring(2)
