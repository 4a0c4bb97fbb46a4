"""V-shaped pipeline schedules (zbv, dualpipev) against the single-device run (tolerances in parity.py):
two chunks per rank in a V (rank 0 holds the embedding and the head), pp 2 and 4, dense and MoE, tied
embeddings, and each composed with DDP, ZeRO-1, ZeRO-3, tensor + sequence parallel, ring context
parallel and expert parallel."""

from __future__ import annotations

import shutil

import pytest

from meshtron.testing.parity import (
    assert_layout_trains_as_one_device,
    assert_losses_match,
    train_rows,
)
from meshtron.testing.tiny import MOE, TINY

MODEL = ["--model.n_layers=8"]
MOE_4 = [*MOE, "--model.n_layers=4"]


def v_pipeline(pp: int, schedule: str, micro_batch: int, *extra: str) -> list[str]:
    return [
        f"--parallel.pp={pp}",
        f"--parallel.pp_schedule={schedule}",
        "--parallel.vpp=2",
        "--parallel.dp_shard=1",
        f"--training.micro_batch={micro_batch}",
        *extra,
    ]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_match_single_device(workers, schedule, pp):
    """8 layers in 2·pp chunks; dualpipev needs 2·pp micro-batches, so both run 8 // micro_batch."""
    micro_batch = 1 if pp == 4 else 2
    assert_layout_trains_as_one_device(workers, MODEL, pp, v_pipeline(pp, schedule, micro_batch))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_moe_under_v_schedules(workers, schedule, pp):
    model = MOE_4 if pp == 2 else [*MOE, "--model.n_layers=8"]  # 2·pp chunks of layers
    micro_batch = 2 if pp == 2 else 1
    assert_layout_trains_as_one_device(workers, model, pp, v_pipeline(pp, schedule, micro_batch))


@pytest.mark.parametrize("pp, schedule", [(2, "zbv"), (4, "dualpipev"), (4, "zbv"), (2, "dualpipev")])
def test_tied_embeddings_on_the_first_rank(workers, pp, schedule):
    """Embedding and head are chunks of rank 0: one matrix, no sum across stages (the losses would drift
    if its gradient were counted twice or the clipping norm missed it)."""
    model = [*MODEL, "--model.tie_embeddings=true"]
    assert_layout_trains_as_one_device(workers, model, pp, v_pipeline(pp, schedule, 8 // (2 * pp)))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_tied_head_and_mtp_on_the_first_rank(workers, schedule):
    """With a tied head and multi-token prediction the embedding on a V's first rank takes three
    gradients per micro-batch (chunk 0's lookup; in the last chunk the head's, in W, and the MTP depth's
    lookup, in B): DDP's bucket waited for two and reduced before the third (every gradient off by
    about half); ZeRO-3's root unit reduced early."""
    model = [
        "--model.name=tiny-deepseek",
        "--model.n_layers=4",
        "--model.tie_embeddings=true",
        "--model.mtp_depth=1",
    ]
    for composed in (["--parallel.dp_replicate=2"], ["--parallel.dp_shard=2", "--parallel.zero=3"]):
        assert_layout_trains_as_one_device(workers, model, 4, v_pipeline(2, schedule, 1, *composed))


COMPOSED = {
    "ddp": ["--parallel.dp_replicate=2"],
    "zero3": ["--parallel.dp_shard=2", "--parallel.zero=3"],
    "zero1": ["--parallel.dp_shard=2", "--parallel.zero=1"],
    "tp2_sp": ["--parallel.tp=2", "--parallel.sp=true"],
    "ring_cp2": ["--parallel.cp=2"],
}


@pytest.mark.parametrize("composed", list(COMPOSED))
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_composed(workers, schedule, composed):
    """pp=2 is the outermost mesh dim: ranks 0 and 1 hold the V's first rank, 2 and 3 its second. Under
    ZeRO-3 the first rank's two boundary chunks both gather the root unit (embedding, norm, head)."""
    layout = v_pipeline(2, schedule, 1, *COMPOSED[composed])
    assert_layout_trains_as_one_device(workers, MODEL, 4, layout)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_with_expert_parallel(workers, schedule):
    """MoE experts split over ep=2 inside each stage of a V pipeline."""
    layout = v_pipeline(2, schedule, 1, "--parallel.ep=2", "--parallel.dp_shard=2")
    assert_layout_trains_as_one_device(workers, MOE_4, 4, layout)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_checkpoint_written_under_a_v_resumes_elsewhere(workers, tmp_path, schedule):
    """Save under a V at pp 2 with tied embeddings (one copy, on rank 0); resume on one device and under 1F1B
    pp 2 (where both end stages hold a copy): each continues as the uninterrupted single-device run."""
    base = [*TINY, "--model.n_layers=4", "--model.tie_embeddings=true", "--training.steps=6"]
    saving = ["--checkpoint.every=3", "--checkpoint.keep=1"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    first = [
        *base,
        *saving,
        *v_pipeline(2, schedule, 2),
        "--training.steps=3",
        f"--run.dir={tmp_path / 'first'}",
    ]
    assert [r["step"] for r in workers(2).run(train_rows, first)[0]] == [1, 2, 3]
    one_f_one_b = ["--parallel.pp=2", "--parallel.dp_shard=1"]
    for name, world, layout in [("single", 1, ["--parallel.dp_shard=1"]), ("1f1b", 2, one_f_one_b)]:
        shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / name / "checkpoints")
        resume = [*base, *saving, *layout, "--checkpoint.resume=true", f"--run.dir={tmp_path / name}"]
        rows = workers(world).run(train_rows, [*resume, "--training.micro_batch=2"])[0]
        assert_losses_match(rows, straight[3:])
