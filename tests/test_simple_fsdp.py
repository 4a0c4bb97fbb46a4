"""SimpleFSDP (`parallel.fsdp_impl = "simple"`): ZeRO-3 as a parametrization, against the single-device
run (fp32: loss relative difference <= 1e-5 at every step of 10, step-1 gradients relative L2 <= 1e-5),
its memory against the ZeRO-3 table and its bytes against the exact count, checkpoints shared with
meshtron's FSDP, and the refusals."""

from __future__ import annotations

import math

import pytest

from meshtron.comm.saved_gathers import SAVED_GATHERS
from meshtron.config.schema import ConfigError
from meshtron.models.llama import build_model
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    merged,
    reference,
    ring,
    run_layout,
    train_rows,
    trainer_for,
)
from meshtron.testing.tiny import TINY

SIMPLE = ["--parallel.zero=3", "--parallel.fsdp_impl=simple"]
LAYOUTS = {
    # name: (world, parallel overrides incl. the per-rank micro-batch)
    "dp_shard2": (2, [*SIMPLE, "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "dp_shard4_accumulate": (4, [*SIMPLE, "--parallel.dp_shard=4", "--training.micro_batch=1"]),
    "hsdp2x2": (4, [*SIMPLE, "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "tp2_sp_dp_shard2": (4, [*SIMPLE, "--parallel.tp=2", "--parallel.sp=true", "--training.micro_batch=4"]),
    "pp2_1f1b_dp_shard2": (4, [*SIMPLE, "--parallel.pp=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "tied_cp2_dp_shard2": (4, [*SIMPLE, "--model.tie_embeddings=true", "--parallel.cp=2", "--training.micro_batch=4"]),
}  # fmt: skip
# the loss all-reduce (one fp32) and the clipping norm's two float64 partial sums
LOSS_BYTES, NORM_BYTES = 4, 16


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_single_device(workers, layout):
    world, parallel = LAYOUTS[layout]
    model = [o for o in parallel if o.startswith("--model.")]
    results = workers(world).run(run_layout, [*TINY, *parallel])
    # Under pp each rank holds its stage's parameters: their gradients together are the model's.
    got = merged(results) if "--parallel.pp=2" in parallel else results[0]
    assert_parity(got, reference(workers(1), model))


def _shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in build_model(load_config(None, TINY).model).parameters()]


@pytest.fixture(scope="module")
def dp_shard4(workers) -> list[dict]:
    return workers(4).run(run_layout, [*TINY, *SIMPLE, "--parallel.dp_shard=4", "--training.micro_batch=2"])


def test_memory_is_zero3s(dp_shard4):
    """fp32 Adam: every rank holds 4 + 4 + 8 bytes per element of its padded row block of each
    parameter, nothing whole: (4Ψ + 4Ψ + 8Ψ)/N."""
    block = sum(-(-d0 // 4) * math.prod(rest) for d0, *rest in _shapes())
    for r in dp_shard4:
        held = r["state_bytes"]
        assert (held["params"], held["grads"], held["optimizer"]) == (4 * block, 4 * block, 8 * block)


def test_bytes_are_three_gathers_less_the_embeddings_backward(dp_shard4):
    """Per step: every parameter all-gathered in forward and reduce-scattered in backward, and gathered
    again in backward where an operator saved it, which is every weight but the embedding table (its
    gradient is a scatter of the output's): (3Ψ - Ψ_emb)·4 bytes of padded row blocks, times (n-1)/n."""
    shapes = _shapes()
    flat = sum(4 * -(-d0 // 4) * math.prod(rest) for d0, *rest in shapes)
    embedding = 4 * -(-shapes[0][0] // 4) * math.prod(shapes[0][1:])  # tok_embeddings comes first
    assert shapes[0] == (load_config(None, TINY).model.vocab_size, load_config(None, TINY).model.dim)
    for row in dp_shard4[0]["rows"]:
        assert row["comm_bytes"] == ((3 * flat - embedding) * 4 + 2 * LOSS_BYTES + 2 * NORM_BYTES) * ring(4)


def test_bf16_tracks_meshtron_fsdp_bf16(workers):
    """bf16 gathers (half the bytes), fp32 reduce-scatters into fp32 row blocks: the losses follow
    meshtron's FSDP under the same mixed precision."""
    common = [
        *TINY,
        "--parallel.dp_shard=2",
        "--training.micro_batch=4",
        "--training.steps=5",
        "--training.dtype=bf16",
    ]
    fsdp = workers(2).run(train_rows, [*common, "--parallel.zero=3"])[0]
    simple = workers(2).run(train_rows, [*common, *SIMPLE])[0]
    for a, b in zip(simple, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 2e-3, (a["step"], a["loss"], b["loss"])
    assert (
        simple[-1]["comm_bytes"] < fsdp[-1]["comm_bytes"]
    )  # bf16 gathers; no backward gather of the embedding


def test_checkpoints_reshard_with_meshtron_fsdp(workers, tmp_path):
    """A checkpoint written under SimpleFSDP over 4 ranks resumes under meshtron's FSDP over 2 and on one
    device, as the uninterrupted run continues."""
    base = [*TINY, "--training.steps=4", "--training.micro_batch=2"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    first = [*base, *SIMPLE, "--parallel.dp_shard=4", "--checkpoint.every=2", "--training.steps=2"]
    workers(4).run(train_rows, [*first, f"--run.dir={tmp_path / 'first'}"])
    for name, world, layout in [("fsdp2", 2, ["--parallel.dp_shard=2", "--parallel.zero=3"]), ("one", 1, [])]:
        resumed = [
            *base,
            *layout,
            "--checkpoint.resume=true",
            f"--checkpoint.dir={tmp_path / 'first' / 'checkpoints'}",
        ]
        rows = workers(world).run(train_rows, [*resumed, f"--run.dir={tmp_path / name}"])[0]
        assert_losses_match(rows, straight[2:])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallel.zero=2"], "set parallel.zero=3"),
        (["--model.name=tiny-moe", "--parallel.ep=2"], "expert-parallel"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--training.micro_batch=1"],
            "split backward",
        ),
    ],
)
def test_unsupported_compositions_are_refused(overrides, message):
    world = 4 if "--parallel.pp=2" in overrides else 2
    cfg = load_config(
        None,
        [
            *TINY,
            "--parallel.fsdp_impl=simple",
            "--parallel.dp_shard=2",
            "--training.micro_batch=4",
            *overrides,
        ],
    )
    with pytest.raises(ConfigError, match=message):
        check(cfg, world)


def gathered_alive_after_forward(overrides: list[str]) -> list[int]:
    """Gathered weights still alive when the model's forward returns (autograd holds what it saved),
    then when the step's backward is done."""
    trainer = trainer_for(overrides)
    saved = SAVED_GATHERS
    counts = []

    def alive() -> int:
        return sum(ref() is not None for ref, _ in list(saved.live.values()))

    trainer.model.register_forward_hook(lambda _m, _a, _o: counts.append(alive()))
    trainer.compute_gradients()
    return [*counts, alive()]


def test_no_gathered_weight_is_kept_for_backward(workers):
    """Every gathered weight is freed as soon as its forward use ends: backward gathers it again (the
    bytes test counts those gathers), so no rank ever holds more than the weights in use."""
    overrides = [*TINY, *SIMPLE, "--parallel.dp_shard=2", "--training.micro_batch=2"]
    for counts in workers(2).run(gathered_alive_after_forward, overrides):
        assert counts == [0, 0, 0]  # two micro-batches' forwards, then the end of the step
