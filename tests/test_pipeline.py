"""Pipeline parallel runtime against the single-device run (tolerances in parity.py): every schedule,
pp in {2, 4}, micro-batches equal to pp and to 2·pp, vpp=2 for interleaved, the MoE model, tied
embeddings, uneven layer splits, and pipeline composed with DDP, ZeRO-1/2/3 and tensor (+ sequence)
parallel."""

from __future__ import annotations

import shutil

import pytest

from meshtron.schedules.build import build_schedule
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    merged,
    reference,
    run_layout,
    train_rows,
    trainer_for,
)
from meshtron.testing.tiny import MOE, TINY

MOE_4 = [*MOE, "--model.n_layers=4"]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
CASES = [
    (name, pp, m, 2 if name == "interleaved" else 1)
    for name in SCHEDULES
    for pp in (2, 4)
    for m in (pp, 2 * pp)
]


def pipeline(pp: int = 2, schedule: str = "1f1b", micro_batch: int = 2, *extra: str) -> list[str]:
    """Overrides for a pipeline layout (dp_shard=1 unless `extra` says otherwise; vpp=2 if interleaved)."""
    vpp = 2 if schedule == "interleaved" else 1
    return [
        f"--parallel.pp={pp}",
        f"--parallel.pp_schedule={schedule}",
        f"--parallel.vpp={vpp}",
        "--parallel.dp_shard=1",
        f"--training.micro_batch={micro_batch}",
        *extra,
    ]


@pytest.mark.parametrize("schedule, pp, microbatches, vpp", CASES)
def test_schedules_match_single_device(workers, schedule, pp, microbatches, vpp):
    model = ["--model.n_layers=8"]
    layout = pipeline(pp, schedule, 8 // microbatches)
    results = workers(pp).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged(results), reference(workers(1), model))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_moe_pipeline_matches_single_device(workers, schedule):
    results = workers(2).run(run_layout, [*TINY, *MOE_4, *pipeline(2, schedule)])
    assert_parity(merged(results), reference(workers(1), MOE_4, micro_batch=2))


@pytest.mark.parametrize(
    "data_parallel",
    [["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.dp_shard=2", "--parallel.zero=1"]],
    ids=["ddp", "zero1"],
)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_pipeline_with_data_parallel(workers, schedule, data_parallel):
    """DDP and ZeRO-1 reduce a chunk's buckets after its last backward; with zero-bubble, the norms'
    gradients are final after the chunk's last B and the linear weights' after its last W."""
    model = ["--model.n_layers=8"]
    layout = pipeline(2, schedule, 2, *data_parallel)
    results = workers(4).run(run_layout, [*TINY, *model, *layout])
    # pp is the outermost mesh dim: ranks 0 and 1 hold the first stage, 2 and 3 the second.
    assert_parity(merged([results[0], results[2]]), reference(workers(1), model))


@pytest.mark.parametrize("pp, schedule", [(2, "1f1b"), (4, "zero_bubble"), (4, "interleaved")])
def test_tied_embeddings_across_first_and_last_stage(workers, pp, schedule):
    """The embedding (first stage) and the head (last stage) share one matrix: its gradient is the sum of
    both stages' parts, and the two copies stay equal step after step (the losses would drift if not)."""
    model = ["--model.n_layers=8", "--model.tie_embeddings=true"]
    layout = pipeline(pp, schedule)
    results = workers(pp).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged(results), reference(workers(1), model))


def test_explicit_and_weighted_layer_splits(workers):
    model = ["--model.n_layers=8"]
    for split in (
        ["--parallel.pp_layers=[1, 7]"],
        ["--parallel.pp_embedding_layers=1", "--parallel.pp_head_layers=2"],
    ):
        layout = pipeline(2, "1f1b", 2, *split)
        results = workers(2).run(run_layout, [*TINY, *model, *layout])
        assert_parity(merged(results), reference(workers(1), model))


@pytest.mark.parametrize(
    "zero, schedule", [(2, "1f1b"), (2, "zero_bubble"), (3, "1f1b"), (3, "interleaved"), (3, "zero_bubble")]
)
def test_pipeline_with_sharded_data_parallel(workers, zero, schedule):
    """ZeRO-2 reduce-scatters every micro-batch's gradients as each chunk's backward produces them; ZeRO-3
    gathers each block's parameters per forward and backward of every micro-batch (and the stage's
    embedding or head with the chunk that holds them)."""
    model = ["--model.n_layers=8"]
    layout = pipeline(2, schedule, 2, "--parallel.dp_shard=2", f"--parallel.zero={zero}")
    results = workers(4).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged([results[0], results[2]]), reference(workers(1), model))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_with_tensor_parallel(workers, schedule, sp):
    """Each stage is tensor parallel over 2 ranks; with sequence parallel the activations passed between
    stages hold half the sequence."""
    model = ["--model.n_layers=8"]
    layout = pipeline(2, schedule, 2, "--parallel.tp=2", f"--parallel.sp={str(sp).lower()}")
    results = workers(4).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged([results[0], results[2]]), reference(workers(1), model))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_zero_bubble_with_tensor_parallel_and_recompute(workers, recompute):
    """Deferred weight gradients under tp (their tp-sum hooks run at W) and under activation recompute
    (which reruns the deferring linear layers inside B)."""
    model = ["--model.n_layers=8"]
    layout = pipeline(
        2, "zero_bubble", 2, "--parallel.tp=2", "--parallel.sp=true", f"--training.recompute={recompute}"
    )
    results = workers(4).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged([results[0], results[2]]), reference(workers(1), model))


def test_pipeline_with_hybrid_sharded_data_parallel(workers):
    """HSDP inside each stage: ZeRO-3 over 2 ranks, replicated over 2 (gradient shards all-reduced)."""
    model = ["--model.n_layers=8"]
    layout = pipeline(
        2, "zero_bubble", 1, "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=3"
    )
    results = workers(8).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged([results[0], results[4]]), reference(workers(1), model))


def test_pipeline_tensor_parallel_tied_zero3(workers):
    """Everything at once on 8 ranks: pp 2 x ZeRO-3 2 x tp 2 with sequence parallel, tied embeddings, MoE."""
    model = [*MOE_4, "--model.tie_embeddings=true"]
    layout = pipeline(
        2, "1f1b", 2, "--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_shard=2", "--parallel.zero=3"
    )
    results = workers(8).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged([results[0], results[4]]), reference(workers(1), model, micro_batch=2))


def test_checkpoint_written_by_a_pipeline_resumes_on_other_layouts(workers, tmp_path):
    """Save under pp 2 x ZeRO-3 2 with tied embeddings (both end stages hold the tied matrix: written
    once); resume on one device and under pp 4 zero-bubble: each continues as the uninterrupted
    single-device run does."""
    base = [*TINY, "--model.n_layers=4", "--model.tie_embeddings=true", "--training.steps=6"]
    saving = ["--checkpoint.every=3", "--checkpoint.keep=1"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    saved_by = pipeline(2, "1f1b", 2, "--parallel.dp_shard=2", "--parallel.zero=3")
    first = [*base, *saving, *saved_by, "--training.steps=3", f"--run.dir={tmp_path / 'first'}"]
    assert [r["step"] for r in workers(4).run(train_rows, first)[0]] == [1, 2, 3]
    for name, world, layout in [
        ("single", 1, ["--parallel.dp_shard=1"]),
        ("pp4", 4, pipeline(4, "zero_bubble")),
    ]:
        shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / name / "checkpoints")
        resume = [*base, *saving, *layout, "--checkpoint.resume=true", f"--run.dir={tmp_path / name}"]
        rows = workers(world).run(train_rows, [*resume, "--training.micro_batch=2"])[0]
        assert_losses_match(rows, straight[3:])


def released_and_sent(overrides: list[str]) -> tuple[int, int]:
    trainer = trainer_for(overrides)
    trainer.compute_gradients()
    pipeline = trainer.parallel.pipeline
    p = trainer.cfg.parallel
    actions = build_schedule(pipeline.pp.size, p.vpp, 4, p.pp_schedule)[pipeline.pp.rank]
    return pipeline.released_outputs, sum(a.kind == "SEND_F" for a in actions)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_sent_stage_outputs_are_released_before_their_backward(workers, schedule):
    """Each stage output's storage is released once its send has finished, before its backward (which
    needs only the graph); the parity tests above show the backward is unaffected."""
    layout = ["--model.n_layers=4", *pipeline(2, schedule)]
    counts = workers(2).run(released_and_sent, [*TINY, *layout])
    assert [released for released, _ in counts] == [sent for _, sent in counts]
    chunks = 2 if schedule == "interleaved" else 1
    assert counts[0][1] == 4 * chunks  # the first rank sends every forward of each of its chunks
