"""Pipeline parallel runtime against the single-device run (tolerances in parity.py): every schedule,
pp in {2, 4}, micro-batches equal to pp and to 2·pp, vpp=2 for interleaved, the MoE model."""

from __future__ import annotations

import pytest
from parity import TINY, assert_parity, reference, run_layout

MOE = ["--model.name=tiny-moe", "--model.n_layers=4"]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
CASES = [
    (name, pp, m, 2 if name == "interleaved" else 1)
    for name in SCHEDULES
    for pp in (2, 4)
    for m in (pp, 2 * pp)
]


def merged(results: list[dict]) -> dict:
    """Each pipeline rank holds different parameters: their gradients together are the whole model's."""
    grads = {}
    for r in results:
        grads.update(r["grads"])
    return {**results[-1], "grads": grads}


@pytest.mark.parametrize("schedule, pp, microbatches, vpp", CASES)
def test_schedules_match_single_device(workers, schedule, pp, microbatches, vpp):
    model = ["--model.n_layers=8"]
    micro = 8 // microbatches
    layout = [
        f"--parallel.pp={pp}",
        f"--parallel.pp_schedule={schedule}",
        f"--parallel.vpp={vpp}",
        "--parallel.dp_shard=1",
        f"--training.micro_batch={micro}",
    ]
    results = workers(pp).run(run_layout, [*TINY, *model, *layout])
    assert_parity(merged(results), reference(workers, model))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_moe_pipeline_matches_single_device(workers, schedule):
    layout = [
        "--parallel.pp=2",
        f"--parallel.pp_schedule={schedule}",
        "--parallel.dp_shard=1",
        "--training.micro_batch=2",
    ]
    results = workers(2).run(run_layout, [*TINY, *MOE, *layout])
    assert_parity(merged(results), reference(workers, MOE, micro_batch=2))


@pytest.mark.parametrize(
    "data_parallel",
    [["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.dp_shard=2", "--parallel.zero=1"]],
    ids=["ddp", "zero1"],
)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_with_data_parallel(workers, schedule, data_parallel):
    model = ["--model.n_layers=8"]
    vpp = 2 if schedule == "interleaved" else 1
    layout = [
        "--parallel.pp=2",
        f"--parallel.pp_schedule={schedule}",
        f"--parallel.vpp={vpp}",
        "--training.micro_batch=2",
        *data_parallel,
    ]
    results = workers(4).run(run_layout, [*TINY, *model, *layout])
    # pp is the outermost mesh dim: ranks 0 and 1 hold the first stage, 2 and 3 the second.
    assert_parity(merged([results[0], results[2]]), reference(workers, model))
