"""The clipping norm is exact and the same in every layout (issue 45.12).

A float32 reduction of millions of gradient elements is off by ~1e-5 relative, by a different amount for
each way the elements are split over ranks, so with clipping on the layouts drifted apart. The sums of
squares are now float64 (engines/engine.py `sum_of_squares`): checked against numpy's float64 sum on
tensors of millions of elements, cut as ZeRO cuts them, and end to end, where DDP and ZeRO-1/2/3 clip by
the same float32 norm at every step and so train bit for bit alike.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshtron.engines.engine import sum_of_squares
from meshtron.testing.parity import run_layout
from meshtron.testing.tiny import TINY


def exact(tensors: list[torch.Tensor]) -> float:
    """numpy's float64 sum of squares (each square of a float32 is exact in float64)."""
    return float(sum(np.sum(t.numpy().astype(np.float64) ** 2) for t in tensors))


def test_sum_of_squares_matches_float64_on_millions_of_elements():
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3_000_000, generator=gen) * 0.01,
        torch.randn(1024, 1031, generator=gen) * 3.0,  # 1.06M elements, more than one piece
        torch.randn(7, generator=gen),
    ]
    truth = exact(tensors)
    assert abs(sum_of_squares(tensors).item() - truth) <= 1e-12 * truth
    # What the float32 reduction gave, for scale: ~1e-6 to 1e-4 off on this data.
    fp32 = torch.stack(torch._foreach_norm(tensors)).double().square().sum().item()
    assert abs(fp32 - truth) > 1e-8 * truth


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_every_row_split_gives_the_same_float32_norm(ranks):
    """ZeRO gives each rank whole rows; however the rows are cut, the float32 norm is the same bits."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4099, 512, generator=gen) * 1e-3, torch.randn(2_500_001, generator=gen)]
    truth = math.sqrt(exact(grads))
    per_rank = [-(-g.shape[0] // ranks) for g in grads]
    parts = torch.stack(
        [
            sum_of_squares([g[r * n : (r + 1) * n] for g, n in zip(grads, per_rank, strict=True)])
            for r in range(ranks)
        ]
    )
    assert parts.dtype == torch.float64
    assert parts.sum().sqrt().float().item() == np.float32(truth)


DP_LAYOUTS = {
    "ddp": ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
    "zero1": ["--parallel.dp_shard=2", "--parallel.zero=1"],
    "zero2": ["--parallel.dp_shard=2", "--parallel.zero=2"],
    "zero3": ["--parallel.dp_shard=2", "--parallel.zero=3"],
}
# A vocabulary of 4,096 makes the embedding and head 262K elements each; grad_clip 0.05 clips every step.
CLIPPED = [
    *TINY,
    "--data.tokenizer=bpe",
    "--model.vocab_size=4096",
    "--training.grad_clip=0.05",
    "--training.micro_batch=4",
]


def test_data_parallel_layouts_clip_by_the_same_norm(workers):
    runs = {
        name: workers(2).run(run_layout, [*CLIPPED, *layout], steps=4)[0]
        for name, layout in DP_LAYOUTS.items()
    }
    ddp = runs["ddp"]
    first = math.sqrt(exact(list(ddp["grads"].values())))
    assert ddp["rows"][0]["grad_norm"] == np.float32(first)  # step 1's norm is the float64 one, rounded
    assert all(row["grad_norm"] > 0.05 for row in ddp["rows"])  # clipping was active at every step
    for name, run in runs.items():
        assert [r["grad_norm"] for r in run["rows"]] == [r["grad_norm"] for r in ddp["rows"]], name
        assert [r["loss"] for r in run["rows"]] == [r["loss"] for r in ddp["rows"]], name
