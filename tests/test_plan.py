"""The planner's model of a layout against what meshtron does on this machine: parameter, gradient and
optimizer-state bytes per rank, and the data-parallel bytes moved per group and step, exactly, for every
engine and the cuts of tp, pp, cp and ep."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.plan.comm import step_bytes
from meshtron.plan.state import state_bytes
from meshtron.testing.parity import trainer_for
from meshtron.testing.tiny import MOE, TINY
from meshtron.train.metrics import model_state_bytes

DATA_GROUPS = {"dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp", "pp_ends", "cp"}
ODD_VOCAB = ["--model.vocab_size=301"]  # tp pads it; ZeRO's row blocks pad it


def measured_state(overrides: list[str]) -> dict:
    """After one step, on every rank: its pipeline stage, whether it is rank 0 of its data-parallel
    shard group (the most loaded), and the bytes it holds."""
    trainer = trainer_for(overrides)
    trainer.step(0)
    second = trainer.step(1)  # the first step also counts DDP's initial broadcast
    mesh = trainer.place.mesh
    first = mesh.local_rank("dp_shard_cp") == 0 and mesh.local_rank("dp_replicate") == 0
    return {
        "pp_rank": mesh.local_rank("pp"),
        "first": first,
        "state": model_state_bytes(trainer.engine, trainer.optimizer),
        "comm": second["comm_bytes_by_group"],
    }


LAYOUTS = {
    "single": (1, []),
    "ddp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "zero1_4": (4, ["--parallel.zero=1", "--training.micro_batch=2"]),
    "zero2_4": (4, ["--parallel.zero=2", "--training.micro_batch=2"]),
    "zero3_4": (4, ["--parallel.zero=3", "--training.micro_batch=2"]),
    "hsdp_2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "tp2_zero3_2": (4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "pp2_zero1_2_tied": (4, ["--parallel.pp=2", "--parallel.zero=1", "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "cp2_zero2": (2, ["--parallel.cp=2", "--parallel.zero=2"]),
    "cp2_allgather_x_dp2": (4, ["--parallel.cp=2", "--parallel.cp_impl=allgather", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "cp4_alltoall_tp1": (4, ["--parallel.cp=4", "--parallel.cp_impl=alltoall", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "tp2_sp_full_recompute_mqa": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=full", "--model.n_kv_heads=1"]),
    "pp2_interleaved_ddp": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved", "--model.n_layers=4", "--training.micro_batch=2"]),
    "moe_tp2_qk_norm": (2, [*MOE, "--parallel.tp=2", "--model.qk_norm=true", "--model.qkv_bias=true"]),
    "moe_ep2_zero3_edp2": (4, [*MOE, "--parallel.ep=2", "--training.micro_batch=2"]),
    "moe_ep2_zero1_tp2_etp1": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=1", "--parallel.zero=1", "--training.micro_batch=4"]),
    "moe_ep2_zero2_edp1": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=2", "--training.micro_batch=4"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_predicted_state_and_traffic_equal_measured(workers, case):
    world, layout = LAYOUTS[case]
    overrides = [*TINY, *ODD_VOCAB, *layout]
    micro = [] if any("micro_batch" in o for o in layout) else ["--training.micro_batch=8"]
    cfg = load_config(None, [*overrides, *micro])
    for result in workers(world).run(measured_state, [*overrides, *micro]):
        if result["first"]:
            assert result["state"] == state_bytes(cfg, world, result["pp_rank"]), result["pp_rank"]
            # Data-parallel and (dense) context-parallel traffic exactly; tp / ep / pp are leading terms.
            want = {g: b for g, b in step_bytes(cfg, world, result["pp_rank"]).items() if g in DATA_GROUPS}
            got = {g: b for g, b in result["comm"].items() if g in DATA_GROUPS}
            assert got == pytest.approx(want, rel=1e-9), result["pp_rank"]
