"""`training.compile = true`: every block's forward compiled, composed with the other parallelisms; the
losses of a few steps equal the eager run's from the same seed and data (fp32, 1e-5). Compiling is slow
on this CPU, so the layouts are few and each puts several parallelisms together."""

from __future__ import annotations

import pytest

from meshtron.testing.parity import trainer_for
from meshtron.testing.tiny import MOE, TINY

STEPS = 2
LAYOUTS = {
    "one_device_full_recompute": (1, ["--training.recompute=full"]),
    "tp2_sp_zero3": (4, ["--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3", "--training.micro_batch=2"]),
    "pp2_ring_cp2_selective": (4, ["--parallel.pp=2", "--parallel.cp=2", "--training.recompute=selective", "--training.micro_batch=2"]),
    "moe_ep2": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=1", "--training.micro_batch=4"]),
    "simple_fsdp_dp_shard2": (2, ["--parallel.zero=3", "--parallel.fsdp_impl=simple", "--training.micro_batch=4"]),
}  # fmt: skip


def losses(overrides: list[str]) -> list[float]:
    trainer = trainer_for(overrides)
    return [trainer.step(step)["loss"] for step in range(STEPS)]


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_compiled_blocks_give_the_eager_losses(workers, case):
    world, layout = LAYOUTS[case]
    overrides = [*TINY, *layout]
    eager = workers(world).run(losses, overrides)[0]
    compiled = workers(world).run(losses, [*overrides, "--training.compile=true"])[0]
    assert len(compiled) == STEPS
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
