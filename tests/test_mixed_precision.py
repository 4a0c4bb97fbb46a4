"""bf16 training holds each weight's compute copy once: the parameters themselves (DDP, ZeRO-1/2) or the
gathered unit (ZeRO-3), shared by every micro-batch in flight, never a copy saved per micro-batch; fp32
masters live in the optimizer (whole, or the owned rows), gradients accumulate in fp32; every layout
tracks the single-device bf16 run."""

from __future__ import annotations

import pytest
import torch

from meshtron.comm.saved_gathers import recording_saves
from meshtron.testing.parity import assert_losses_match, train_rows, trainer_for
from meshtron.testing.tiny import MOE, TINY

BF16 = [*TINY, "--training.dtype=bf16", "--training.steps=3"]


def weight_copies_saved(overrides: list[str]) -> dict[str, int]:
    """One step's forwards and backwards with every tensor autograd saves recorded: how many saved
    tensors hold a parameter's values in bf16, and how many of those are copies (other storage) rather
    than the parameter itself."""
    trainer = trainer_for(overrides)
    params = [p for p in trainer.model.parameters() if p.dim() >= 2 and p.untyped_storage().nbytes()]
    saved: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> None:
        if t.dtype == torch.bfloat16 and t.dim() >= 2:
            saved.append(t)

    with recording_saves(record):
        trainer.compute_gradients()
    storages = {p.untyped_storage().data_ptr() for p in params}

    def holds_a_weight(t: torch.Tensor) -> bool:  # a weight's values in bf16 (or their transpose)
        weights = (w.to(t.dtype) for p in params for w in (p.detach(), p.detach().t()) if w.shape == t.shape)
        return any(torch.equal(t, w) for w in weights)

    return {
        "params_bf16": sum(p.dtype == torch.bfloat16 for p in params),
        "weights_saved": sum(t.untyped_storage().data_ptr() in storages for t in saved),
        "copies": sum(t.untyped_storage().data_ptr() not in storages and holds_a_weight(t) for t in saved),
    }


@pytest.mark.parametrize(
    "world, layout",
    [
        (1, ["--training.micro_batch=2"]),  # 4 micro-batches, one after another
        (2, ["--parallel.pp=2", "--training.micro_batch=1"]),  # 1F1B: several in flight on stage 0
        (2, ["--parallel.zero=1", "--training.micro_batch=2"]),
        (2, ["--parallel.zero=2", "--parallel.tp=2", "--parallel.sp=true", "--training.micro_batch=2"]),
    ],
    ids=["single_accumulating", "pp2_1f1b", "zero1", "zero2_tp2_sp"],
)
def test_bf16_weights_are_held_once_and_never_copied_per_micro_batch(workers, world, layout):
    for result in workers(world).run(weight_copies_saved, [*BF16, *layout]):
        assert result["params_bf16"] > 0
        assert result["weights_saved"] > 0  # the matmuls saved their weights: the parameters themselves
        assert result["copies"] == 0


def masters_and_grads(overrides: list[str]) -> dict:
    """After one step: the dtypes of the module parameters, of the optimizer's, and of their gradients."""
    trainer = trainer_for(overrides)
    trainer.step(0)
    trainer.compute_gradients()
    return {
        "module": {str(p.dtype) for p in trainer.model.parameters()},
        "optimizer": {str(p.dtype) for p in trainer.engine.optimizer_params()},
        "grads": {str(e.param.grad.dtype) for e in trainer.engine.owned_rows() if e.param.grad is not None},
    }


@pytest.mark.parametrize(
    "layout",
    [["--parallel.dp_replicate=2", "--parallel.dp_shard=1"], ["--parallel.zero=1"], ["--parallel.zero=2"]],
)
def test_masters_and_gradients_are_fp32(workers, layout):
    for result in workers(2).run(masters_and_grads, [*BF16, "--training.micro_batch=2", *layout]):
        assert result == {
            "module": {"torch.bfloat16"},
            "optimizer": {"torch.float32"},
            "grads": {"torch.float32"},
        }


# name: (ranks, the model's overrides, the layout's)
LAYOUTS = {
    "ddp2": (2, [], ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"]),
    "zero1_2": (2, [], ["--parallel.zero=1"]),
    "zero2_2": (2, [], ["--parallel.zero=2"]),
    "zero3_2": (2, [], ["--parallel.zero=3"]),
    "tp2_sp": (2, [], ["--parallel.tp=2", "--parallel.sp=true"]),
    "pp2_1f1b": (2, [], ["--parallel.pp=2"]),
    "pp2_zbv_tied": (2, ["--model.n_layers=4", "--model.tie_embeddings=true"], ["--parallel.pp=2", "--parallel.pp_schedule=zbv"]),
    "ep2_moe_zero1": (2, MOE, ["--parallel.ep=2", "--parallel.zero=1"]),
}  # fmt: skip


def test_every_layout_tracks_the_single_device_bf16_run(workers, tmp_path):
    """To bf16's precision (1e-2 relative over three steps), as the cp and ep tests ask of theirs."""
    base = [*BF16, "--training.micro_batch=2"]
    single: dict[tuple[str, ...], list[dict]] = {}
    for name, (world, model, layout) in LAYOUTS.items():
        if tuple(model) not in single:
            run_dir = f"--run.dir={tmp_path / f'single{len(single)}'}"
            single[tuple(model)] = workers(1).run(train_rows, [*base, *model, run_dir])[0]
        rows = workers(world).run(train_rows, [*base, *model, *layout, f"--run.dir={tmp_path / name}"])[0]
        assert_losses_match(rows, single[tuple(model)], rtol=1e-2)
