"""Host reads of the device in a training step (issue 34.3): each one is a synchronisation on a GPU, so
docs/performance.md lists every one the step makes, and this test counts them (meshtron.testing.host_reads:
the Tensor methods that copy to the host and the operators whose output size depends on the data, when
meshtron's code calls them) on every rank, exactly."""

from __future__ import annotations

import pytest

from meshtron.testing.host_reads import step_host_reads
from meshtron.testing.tiny import MOE, TINY

BASE = [*TINY, "--run.sample_tokens=0"]
STEP = {"train.trainer:step tolist": 1}  # the loss and the gradient norm, once, for the skip decision
LOADS = {"observe.expert_load:after_step tolist": 1}  # every MoE layer's expert loads, once


def per_layer(reads: dict[str, int], layers: int, micro_batches: int) -> dict[str, int]:
    return {k: v * layers * micro_batches for k, v in reads.items()}


# Per MoE layer and micro-batch: the kept assignments of this rank's experts (a sized nonzero), and under
# the all-to-all dispatch the split sizes of the uneven exchange, in one read.
SORT = {"models.moe:sort_by_expert nonzero": 1}
SPLITS = {"parallel.expert:__call__ tolist": 1}

CASES = {
    "dense": (1, [], STEP),
    "dp2_zero3": (2, ["--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=4"], STEP),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"], STEP),
    # The pipeline's bubble, averaged over the stages for the metrics row.
    "pp2": (2, ["--parallel.pp=2", "--training.micro_batch=2"], {**STEP, "train.trainer:step float": 1}),
    "moe": (1, MOE, {**STEP, **LOADS, **per_layer(SORT, 2, 1)}),
    "moe_ep2_alltoall": (
        2,
        [*MOE, "--parallel.ep=2", "--parallel.dp_shard=2", "--training.micro_batch=2"],
        {**STEP, **LOADS, **per_layer(SORT, 2, 2), **per_layer(SPLITS, 2, 2)},
    ),
    # With a capacity the all-to-all dispatch exchanges fixed slots: it reads nothing, nor sorts.
    "moe_ep2_alltoall_capacity": (
        2,
        [
            *MOE,
            "--model.capacity_factor=1.5",
            "--parallel.ep=2",
            "--parallel.dp_shard=2",
            "--training.micro_batch=2",
        ],
        {**STEP, **LOADS},
    ),
    "moe_ep2_allgather": (
        2,
        [
            *MOE,
            "--parallel.ep=2",
            "--parallel.dp_shard=2",
            "--training.micro_batch=2",
            "--parallel.ep_dispatch=allgather",
        ],
        {**STEP, **LOADS, **per_layer(SORT, 2, 2)},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_reads_the_device_only_where_docs_say(workers, case):
    world, overrides, want = CASES[case]
    for rank, reads in enumerate(workers(world).run(step_host_reads, [*BASE, *overrides])):
        assert reads == want, f"rank {rank}"


# Context parallel's blockwise attention plans its tiles from the positions of each block, known on the
# host as runs of consecutive positions (models/block_positions.py): it reads nothing from the device.
@pytest.mark.parametrize("impl", ["ring", "allgather", "alltoall"])
def test_context_parallel_reads_nothing_more(workers, impl):
    overrides = [*BASE, "--parallel.cp=2", f"--parallel.cp_impl={impl}"]
    for rank, reads in enumerate(workers(2).run(step_host_reads, overrides)):
        assert reads == STEP, f"rank {rank}"
