"""Tensor and sequence parallel (and recompute, and tp x data parallel) against the single-device run:
losses over 10 steps and step-1 gradients gathered back to logical shape (tolerances in parity.py)."""

from __future__ import annotations

import pytest
from parity import TINY, assert_parity, reference, run_layout

MOE = ["--model.name=tiny-moe", "--model.shared_expert_gate=true", "--model.z_loss_coef=0.001"]

CASES = {
    # name: (world, model overrides, parallel overrides)
    "tp2": (2, [], ["--parallel.tp=2"]),
    "tp2_sp": (2, [], ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_kv_replicated": (4, [], ["--parallel.tp=4"]),  # 2 kv heads on 4 ranks
    "tp4_sp": (4, [], ["--parallel.tp=4", "--parallel.sp=true"]),
    "tp2_mqa": (2, ["--model.n_kv_heads=1"], ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_odd_vocab": (4, ["--model.vocab_size=301"], ["--parallel.tp=4", "--parallel.sp=true"]),
    "tp2_tied": (2, ["--model.tie_embeddings=true", "--model.vocab_size=301"], ["--parallel.tp=2"]),
    "tp2_qk_norm_bias": (2, ["--model.qk_norm=true", "--model.qkv_bias=true"], ["--parallel.tp=2"]),
    "tp2_moe_sp": (2, MOE, ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_moe": (4, MOE, ["--parallel.tp=4"]),
    "tp2_x_fsdp2": (
        4,
        [],
        ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=2"],
    ),
    "tp2_sp_x_ddp2": (
        4,
        [],
        [
            "--parallel.tp=2",
            "--parallel.sp=true",
            "--parallel.dp_replicate=2",
            "--parallel.dp_shard=1",
            "--training.micro_batch=4",
        ],
    ),
    "tp2_sp_full_recompute": (2, [], ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=full"]),
    "tp2_selective_recompute": (2, [], ["--parallel.tp=2", "--training.recompute=selective"]),
    "fsdp2_full_recompute": (
        2,
        [],
        ["--parallel.dp_shard=2", "--training.recompute=full", "--training.micro_batch=4"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_device(workers, case):
    world, model, parallel = CASES[case]
    micro = [] if any("micro_batch" in p for p in parallel) else ["--training.micro_batch=8"]
    results = workers(world).run(run_layout, [*TINY, *model, *parallel, *micro])
    assert_parity(results[0], reference(workers, model))
    for other in results[1:]:
        assert [r["loss"] for r in other["rows"]] == [r["loss"] for r in results[0]["rows"]]
