"""`training.compile = true`: every block's forward compiled, composed with the other parallelisms; the
losses of a few steps equal the eager run's from the same seed and data (fp32, 1e-5). Compiling is slow
on this CPU, so the layouts are few and each puts several parallelisms together."""

from __future__ import annotations

import re

import pytest
import torch

from meshtron.testing.parity import assert_parity, reference, run_layout, train_rows, trainer_for
from meshtron.testing.tiny import MOE, TINY

STEPS = 2
LAYOUTS = {
    "one_device_full_recompute": (1, ["--training.recompute=full"]),
    "moe_ep2_x_tp2_sp_zero3": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3", "--training.micro_batch=2"]),
    "pp2_ring_cp2_selective": (4, ["--parallel.pp=2", "--parallel.cp=2", "--training.recompute=selective", "--training.micro_batch=2"]),
}  # fmt: skip


def losses(overrides: list[str]) -> list[float]:
    # A fresh compiler cache: a worker that compiled many layouts would reach dynamo's recompile limit
    # and run the block eagerly, which would pass for the wrong reason.
    torch.compiler.reset()
    trainer = trainer_for(overrides)
    return [trainer.step(step)["loss"] for step in range(STEPS)]


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_compiled_blocks_give_the_eager_losses(workers, case):
    world, layout = LAYOUTS[case]
    overrides = [*TINY, *layout]
    eager = workers(world).run(losses, overrides)[0]
    pool = workers(world)
    with pool.waiting_up_to(600):  # four ranks compiling on two cores of a busy machine took over 180 s
        compiled = pool.run(losses, [*overrides, "--training.compile=true"])[0]
    assert len(compiled) == STEPS
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


SIMPLE = [
    "--parallel.zero=3",
    "--parallel.fsdp_impl=simple",
    "--parallel.dp_shard=2",
    "--training.micro_batch=4",
]
CALLS = re.compile(
    r"torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)(?:_out)?\.default\("
)


def compiled_simple_fsdp(overrides: list[str]) -> dict:
    """`run_layout` (step-1 gradients, 6 steps) of SimpleFSDP with compiled blocks, the collective calls
    in the code inductor wrote for them, and how many parameters each block has."""
    from torch._inductor.utils import run_and_get_code  # test-only: the generated source

    torch.compiler.reset()  # as in `losses`: compiled here, not skipped past a recompile limit
    result, codes = run_and_get_code(run_layout, [*overrides, "--training.compile=true"])
    result["graphs"] = [g for g in ([m.group(1) for m in CALLS.finditer(code)] for code in codes) if g]
    result["per_block"] = len(list(trainer_for(overrides).model.layers["0"].parameters()))
    return result


def test_simple_fsdp_compiles_with_its_collectives_bucketed_in_the_graph(workers):
    """SimpleFSDP's point: with the gathers in the compiled graph, inductor buckets them. Compiled at
    dp_shard 2 it matches the single-device run (6 steps, loss rel 1e-5, step-1 gradients rel L2
    1e-5); each block's forward graph holds fewer all-gathers than the block has parameters (one,
    bucketed), its backward graph gathers again (nothing gathered was saved) and reduce-scatters in
    fewer calls than parameters; the bytes booked for the traced collectives equal the eager run's
    counted bytes."""
    overrides = [*TINY, *SIMPLE]
    compiled = workers(2).run(compiled_simple_fsdp, overrides)[0]
    assert_parity(compiled, reference(workers(1), []))
    eager = workers(2).run(train_rows, overrides)[0]
    steps = len(compiled["rows"])  # (train_rows runs the config's 10 steps)
    assert [r["comm_bytes"] for r in compiled["rows"]] == [r["comm_bytes"] for r in eager[:steps]]
    forward = [g for g in compiled["graphs"] if "reduce_scatter_tensor" not in g]
    backward = [g for g in compiled["graphs"] if "reduce_scatter_tensor" in g]
    assert forward and backward
    for graph in forward:
        assert 1 <= graph.count("all_gather_into_tensor") < compiled["per_block"]
    for graph in backward:
        assert 1 <= graph.count("all_gather_into_tensor") < compiled["per_block"]
        assert 1 <= graph.count("reduce_scatter_tensor") < compiled["per_block"]
