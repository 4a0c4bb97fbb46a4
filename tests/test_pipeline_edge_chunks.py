"""Pipeline chunks that hold no transformer layer: the first chunk with the embedding alone and the last
with the final norm, head and loss alone (Megatron-Core's layouts that count the embedding and the loss
as a layer each), in every schedule, against the single-device run."""

from __future__ import annotations

import pytest

from meshtron.testing.parity import assert_parity, merged, reference, run_layout
from meshtron.testing.tiny import MOE, TINY

CASES = {
    "1f1b, embedding alone": ["--parallel.pp_layers=[0, 2]"],
    "1f1b, head alone": ["--parallel.pp_layers=[2, 0]"],
    "interleaved, both weighed": [
        "--parallel.vpp=2",
        "--parallel.pp_schedule=interleaved",
        "--parallel.pp_embedding_layers=1",
        "--parallel.pp_head_layers=1",
    ],
    "zero_bubble, embedding alone": ["--parallel.pp_schedule=zero_bubble", "--parallel.pp_layers=[0, 2]"],
    "dualpipev, both alone": ["--parallel.pp_schedule=dualpipev", "--parallel.pp_layers=[0, 1, 1, 0]"],
}


@pytest.mark.parametrize("split", CASES.values(), ids=CASES.keys())
def test_edge_chunks_without_layers_match_single_device(workers, split):
    model = ["--model.n_layers=2"]
    layout = ["--parallel.pp=2", "--parallel.dp_shard=1", "--training.micro_batch=2", *split]
    results = workers(2).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged(results), reference(workers(1), model))


def test_edge_chunks_under_zero3_and_with_moe_and_mtp(workers):
    """ZeRO-3 gathers the embedding-only chunk's unit; the head-only chunk carries the MoE model's
    multi-token prediction depth."""
    model = ["--model.n_layers=2"]
    layout = ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=2"]
    results = workers(4).run(run_layout, [*TINY, *model, *layout, "--parallel.pp_layers=[0, 2]"])
    assert_parity(merged([results[0], results[2]]), reference(workers(1), model))
    moe = [*MOE, "--model.n_layers=2", "--model.mtp_depth=1"]
    layout = [
        "--parallel.pp=2",
        "--parallel.dp_shard=1",
        "--training.micro_batch=2",
        "--parallel.pp_layers=[2, 0]",
    ]
    results = workers(2).run(run_layout, [*TINY, *moe, *layout])
    assert_parity(merged(results), reference(workers(1), moe, micro_batch=2))
