"""Stacks of expert matrices cut within their matrices (config/row_blocks.py): when the expert-data-
parallel group is larger than a rank's experts, each rank holds a row block of one expert's matrix and
nothing is padded. The rule itself, and every sharded engine run that way against the single device."""

from __future__ import annotations

import pytest

from meshtron.config.row_blocks import block_box, padded_numel, row_shape
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


def test_a_stack_the_group_does_not_divide_is_cut_within_its_matrices():
    # Qwen3-235B under FSDP with ep 8 on 256 GPUs: 16 local experts over 32 edp ranks.
    assert row_shape((16, 1536, 4096), 32) == (16 * 1536, 4096)
    assert padded_numel((16, 1536, 4096), 32) == 16 * 1536 * 4096  # cut along E: twice that
    assert padded_numel((16, 1536, 4096), 32, cut_within=False) == 2 * 16 * 1536 * 4096
    # Whole experts where the group divides them, and 2-D matrices always by their own rows.
    assert row_shape((32, 1536, 4096), 16) == (32, 1536, 4096)
    assert row_shape((1000, 4096), 48) == (1000, 4096)
    # Blocks that would straddle two matrices, or a group that does not divide the rows: as before.
    assert row_shape((3, 10, 8), 4) == (3, 10, 8)
    assert row_shape((2, 96, 8), 5) == (2, 96, 8)
    assert row_shape((16, 1536, 4096), 32, cut_within=False) == (16, 1536, 4096)
    # Rank 3 of 4 holding rows of one expert of a [2, 96, 8] stack: the second half of expert 1.
    assert block_box((2, 96, 8), (192, 8), 144, 48) == ([1, 48, 0], [1, 48, 8])
    assert block_box((6, 8), (6, 8), 4, 2) == ([4, 0], [2, 8])


ONE_EXPERT_PER_EP_RANK = [*MOE, "--model.n_experts=2", "--training.micro_batch=2"]
ENGINES = {
    "zero1 ep2 x edp2": ["--parallel.ep=2", "--parallel.zero=1"],
    "zero2 ep2 x edp2": ["--parallel.ep=2", "--parallel.zero=2"],
    "zero3 ep2 x edp2": ["--parallel.ep=2", "--parallel.zero=3"],
    "zero3 over dp_shard 4, no ep": ["--parallel.zero=3"],
    "simple_fsdp over dp_shard 4": ["--parallel.fsdp_impl=simple"],
}
# Experts cut by tp too (etp 2: w1's rows, w2's columns), then their tp-local rows by edp 2.
TP_CUT = ["--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=2", "--parallel.sp=true"]


def rows_cut_within(overrides: list[str]) -> dict[str, tuple[int, ...]]:
    """The parameters this rank's engine cut within their matrices, with their row shapes."""
    return {e.name: e.row_shape for e in trainer_for(overrides).engine.owned_rows() if e.row_shape}


@pytest.mark.parametrize("layout", ENGINES.values(), ids=ENGINES.keys())
def test_experts_cut_within_their_matrices_train_as_one_device(workers, layout):
    overrides = [*TINY, *ONE_EXPERT_PER_EP_RANK, *layout]
    cut = workers(4).run(rows_cut_within, overrides)
    assert all(any(name.endswith("experts.w1") for name in ranks) for ranks in cut), cut
    results = workers(4).run(run_layout, overrides)
    assert_parity(merged(results), reference(workers(1), ONE_EXPERT_PER_EP_RANK[:-1]))


def test_experts_cut_by_tp_then_within_their_matrices_save_and_resume(workers, tmp_path):
    """tp 2 x dp_shard 4, ep 2 with etp 2: each rank holds a quarter of an expert's matrix; trains as one
    device does, and its checkpoint resumes on one device as the uninterrupted run continues."""
    base = [*TINY, *ONE_EXPERT_PER_EP_RANK, "--training.steps=4"]
    cut = workers(8).run(rows_cut_within, [*base, *TP_CUT])
    assert all(ranks["layers.0.moe.experts.w2"] == (64, 48) for ranks in cut), cut
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    saving = [*base, *TP_CUT, "--checkpoint.every=2", "--training.steps=2", f"--run.dir={tmp_path / 'a'}"]
    first = workers(8).run(train_rows, saving)[0]
    assert_losses_match(first, straight[:2])
    resumed = [*base, "--checkpoint.resume=true", f"--checkpoint.dir={tmp_path / 'a' / 'checkpoints'}"]
    rows = workers(1).run(train_rows, [*resumed, f"--run.dir={tmp_path / 'b'}"])[0]
    assert [r["step"] for r in rows] == [3, 4]
    assert_losses_match(rows, straight[2:])


WIDER = {
    "hsdp 2 x (ep2 x edp2)": [
        "--parallel.dp_replicate=2",
        "--parallel.dp_shard=4",
        "--parallel.ep=2",
        "--training.micro_batch=1",
    ],
    "pp2 x zero3 (ep2 x edp2)": [
        "--parallel.pp=2",
        "--parallel.dp_shard=4",
        "--parallel.ep=2",
        "--model.n_layers=4",
        "--training.micro_batch=1",
    ],
}


@pytest.mark.parametrize("layout", WIDER.values(), ids=WIDER.keys())
def test_experts_cut_within_under_hsdp_and_pipeline(workers, layout):
    """Replicas all-reduce their cut shards (HSDP); a pipeline's stages each cut their own experts."""
    overrides = [*TINY, *ONE_EXPERT_PER_EP_RANK, *layout]
    assert all(
        any(n.endswith("experts.w1") for n in ranks) for ranks in workers(8).run(rows_cut_within, overrides)
    )
    results = workers(8).run(run_layout, overrides)
    model = [o for o in layout if o.startswith("--model")]
    ref = reference(workers(1), [*ONE_EXPERT_PER_EP_RANK[:-1], *model])
    assert_parity(merged(results), ref)


def test_a_checkpoint_of_experts_cut_within_resumes_anywhere(workers, tmp_path):
    """Saved with each rank holding half of an expert's rows (ZeRO-3, ep 2 x edp 2): resumed on one device,
    under ZeRO-3 over 4 ranks without ep (cut again, other halves), and under ZeRO-1 with whole experts
    (2 ranks), each continues as the uninterrupted single-device run does; and back the other way."""
    base = [*TINY, *ONE_EXPERT_PER_EP_RANK, "--training.steps=4"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    for first, world, later in [
        ("--parallel.ep=2", 1, []),
        ("--parallel.ep=2", 4, ["--parallel.zero=3"]),
        ("--parallel.ep=2", 2, ["--parallel.ep=2", "--parallel.zero=1"]),
        ("--parallel.zero=1", 4, ["--parallel.ep=2"]),
    ]:
        out = tmp_path / f"{first}-{world}-{'_'.join(later)}"
        saving = [*base, first, "--checkpoint.every=2", "--training.steps=2"]
        workers(2 if first == "--parallel.zero=1" else 4).run(train_rows, [*saving, f"--run.dir={out / 'a'}"])
        resumed = [*base, *later, "--checkpoint.resume=true", f"--checkpoint.dir={out / 'a' / 'checkpoints'}"]
        rows = workers(world).run(train_rows, [*resumed, f"--run.dir={out / 'b'}"])[0]
        assert [r["step"] for r in rows] == [3, 4]
        assert_losses_match(rows, straight[2:])
