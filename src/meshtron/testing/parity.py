"""Parity with the single-device run, the definition of correct for every parallel layout.

`run_layout` runs a layout for 6 steps on every rank of a worker pool (comm/workers.py) and returns each
rank's losses and its step-1 gradients gathered back to logical shape; `reference` is the same on one
device (computed once per model and data config and reused); `assert_parity` compares them in fp32:

  loss        relative difference <= 1e-5 at every step
  gradients   per-parameter relative L2 error <= 1e-5
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm.mesh import ParallelMesh
from meshtron.comm.workers import WorkerPool
from meshtron.config.layout import ParallelDims
from meshtron.observe.metrics import model_state_bytes
from meshtron.rules.checks import load_config
from meshtron.testing.tiny import TINY
from meshtron.train.trainer import Trainer

STEPS = 6
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5

# The meshes of a worker's last layouts, the most recent last. A worker runs hundreds of jobs; building a
# mesh takes about 0.1 s, but each holds 20-40 gloo threads a rank that wake to poll while it sits idle
# (an 8-rank pool holding 100 a rank spent a quarter of a core doing nothing), so older ones are closed.
# Two, not one: a job may build a second layout's trainer while its first is still in use.
KEPT_MESHES = 2
_MESHES: dict[ParallelDims, ParallelMesh] = {}
# The trainer each kept mesh was last handed to. A job returns after some steps with collectives still in
# flight (ZeRO-1/2 post the next step's first all-gathers as a step ends); dropped so, their messages stay
# on the mesh's groups, where the next trainer's first all-gathers on them would take them (a hang, seen
# under load). Each one's are waited for (as Trainer.run does at its end) before its mesh serves another.
_TRAINERS: dict[ParallelDims, Trainer] = {}


def _settle(dims: ParallelDims) -> None:
    trainer = _TRAINERS.pop(dims, None)
    if trainer is not None:
        trainer.engine.finish_params()


def drop_trainer(trainer: Trainer) -> None:
    """Wait for `trainer`'s in-flight collectives and let go of it: a job that must see a trainer collected
    calls this first, since this module keeps the last trainer of each mesh."""
    for dims, kept in list(_TRAINERS.items()):
        if kept is trainer:
            _settle(dims)


def mesh_for(dims: ParallelDims) -> ParallelMesh:
    """This worker's mesh for `dims`: built on first use and kept while it is among the last KEPT_MESHES
    asked for; every rank of the pool asks in the same order, so all close the same ones together."""
    mesh = _MESHES.pop(dims, None) or ParallelMesh(dims, "cpu")
    _MESHES[dims] = mesh
    stale = list(_MESHES)[:-KEPT_MESHES]
    for old in stale:
        _settle(old)
        _MESHES.pop(old).close()
    if stale:  # a DeviceMesh and its flattened views form reference cycles that hold their groups
        gc.collect()
    return mesh


def release_meshes() -> None:
    """Close every mesh this worker keeps: what a pool left idle runs so its ranks stop polling."""
    while _MESHES:  # no local names the last mesh when the collection runs, which would keep it
        dims = next(reversed(_MESHES))
        _settle(dims)
        _MESHES.pop(dims).close()
    gc.collect()


def trainer_for(overrides: list[str], config: Path | None = None) -> Trainer:
    """A Trainer on this worker's mesh for the layout (`config` a TOML file the overrides apply to)."""
    cfg = load_config(config, overrides)
    if not dist.is_initialized():
        return Trainer(cfg, None)
    dims = cfg.parallel.dims(dist.get_world_size())
    _settle(dims)
    trainer = _TRAINERS[dims] = Trainer(cfg, mesh_for(dims))
    return trainer


def run_layout(overrides: list[str], steps: int = STEPS) -> dict[str, Any]:
    """On every rank: the step-1 gradients (whole, logical shapes, before clipping) and `steps` steps of
    metrics, from one trainer: its first step's gradients are read as its backward ends, by collectives
    that stay out of that step's statistics."""
    trainer = trainer_for(overrides)
    compute, grads = trainer.compute_gradients, {}

    def first_step_gradients() -> torch.Tensor:
        trainer.compute_gradients = compute  # the later steps compute as the trainer does
        loss_sum = compute()
        with trainer.comm.unrecorded():
            full = trainer.engine.full_gradients(trainer.comm)
            if trainer.parallel.tp_plan is not None:
                full = trainer.parallel.tp_plan.gather_full(full, trainer.comm)
        grads.update(full)
        return loss_sum

    trainer.compute_gradients = first_step_gradients
    rows = [trainer.step(step) for step in range(steps)]
    mesh = trainer.job.place.mesh
    return {
        "grads": grads,
        "rows": rows,
        # Where plan/comm.py's step_bytes speaks for this rank: its stage, and whether it is rank 0 of
        # its data-parallel group (the most loaded, which the formula describes)
        "pp_rank": mesh.local_rank("pp"),
        "dp_first": mesh.local_rank("dp_shard_cp") == 0 and mesh.local_rank("dp_replicate") == 0,
        "cp_exchange": trainer.cfg.parallel.cp_exchange,  # "auto" as the run resolved it
        "state_bytes": model_state_bytes(
            trainer.engine, trainer.optimizer, trainer.job.outer.tensors() if trainer.job.outer else ()
        ),
        "n_params": trainer.job.n_params,
    }


def comm_by_op(overrides: list[str], groups: tuple[str, ...], ops: tuple[str, ...]) -> dict[str, float]:
    """Bytes per collective over `groups`, as the comm layer counts them, of one step's forwards and
    backwards (no clipping, no optimizer)."""
    trainer = trainer_for(overrides)
    with trainer.comm.recording() as recorded:
        trainer.compute_gradients()
    stats = recorded.stats
    return {op: sum(stats.total_bytes(group=g, op=op) for g in groups) for op in ops}


def train_rows(overrides: list[str], config: Path | None = None) -> list[dict[str, Any]]:
    return trainer_for(overrides, config).run()


def save_after(overrides: list[str], steps: int) -> None:
    """On every rank: the config's first `steps` steps, then its checkpoint of step `steps`, as `train`
    writes it (the run's own step count, and so its learning-rate schedule, unchanged)."""
    trainer = trainer_for(overrides)
    for step in range(steps):
        trainer.step(step)
    trainer.save(steps)
    if trainer.checkpointer is not None:
        trainer.checkpointer.wait()


def resumed_rows(overrides: list[str], steps: int) -> list[dict[str, Any]]:
    """On every rank: the metric rows of a run resumed from its newest checkpoint (checkpoint.resume in
    `overrides`), from the step it resumes at to `steps`."""
    trainer = trainer_for(overrides)
    return [trainer.step(step) for step in range(trainer.job.start_step, steps)]


def val_losses(overrides: list[str], steps: int = 2, evaluate: bool = True) -> list[tuple[float, float]]:
    """On every rank: (training loss, validation loss after it) of `steps` steps (validation NaN without
    `evaluate`: then the training losses show what evaluating changes of training, which is nothing)."""
    trainer = trainer_for(overrides)
    out = []
    for step in range(steps):
        loss = trainer.step(step)["loss"]
        out.append((loss, trainer.evaluator.evaluate(step + 1)["val_loss"] if evaluate else float("nan")))
    return out


_SINGLE_DEVICE: dict[tuple[str, ...], dict[str, Any]] = {}


def reference(pool: WorkerPool, extra: list[str], micro_batch: int = 8) -> dict[str, Any]:
    """The single-device run for a model/data config, computed once per process, in a one-rank worker
    (one thread, like the parallel ranks).

    Dense models give the same result for any micro-batch size, so the reference takes the whole batch
    at once. An MoE layer's load-balancing loss is a statistic of each micro-batch's tokens, so MoE runs
    under data parallelism are compared with a reference that groups the sequences the same way (the
    data-parallel ranks' slices are consecutive runs of the global batch, as micro-batches are)."""
    key = (*extra, str(micro_batch))
    if key not in _SINGLE_DEVICE:
        overrides = [*TINY, *extra, f"--training.micro_batch={micro_batch}"]
        _SINGLE_DEVICE[key] = pool.run(run_layout, overrides)[0]
    return _SINGLE_DEVICE[key]


def ring(n: int) -> float:
    """Bytes a rank moves per byte of an all-gather or reduce-scatter over n ranks (an all-reduce: twice
    that), as the comm layer counts them (docs/theory.md#communication-volume)."""
    return (n - 1) / n


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def assert_losses_match(
    rows: list[dict[str, Any]], want: list[dict[str, Any]], rtol: float = LOSS_RTOL
) -> None:
    """Two runs' metric rows: the same steps, and losses within `rtol` at every step."""
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    for got, expected in zip(rows, want, strict=True):
        assert relative(got["loss"], expected["loss"]) <= rtol, (got["step"], got["loss"], expected["loss"])


def pipelined(overrides: list[str]) -> bool:
    """Whether the layout of `overrides` has pipeline stages (each rank then holds its stage's share)."""
    return any(o.startswith("--parallel.pp=") and o != "--parallel.pp=1" for o in overrides)


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each pipeline rank holds different parameters: their gradients together are the whole model's.
    A parameter two stages hold (the tied embedding) must have the same gradient on both."""
    grads = {}
    for r in results:
        for name, grad in r["grads"].items():
            if name in grads:
                assert torch.equal(grads[name], grad), f"{name}: the stages' copies differ"
            grads[name] = grad
    return {**results[-1], "grads": grads}


def assert_layout_trains_as_one_device(
    workers: Callable[[int], WorkerPool], model: list[str], world: int, layout: list[str]
) -> None:
    """`layout` on `world` ranks against one device, both on `model` plus the layout's own --model.* flags
    and with the layout's micro-batch (8 unless it says; MoE's balance loss depends on it): losses and
    step-1 gradients (a pipeline's stages' merged) match."""
    model = [*model, *(x for x in layout if x.startswith("--model."))]
    parallel = [x for x in layout if not x.startswith("--model.")]
    micro = next((int(x.split("=")[1]) for x in parallel if x.startswith("--training.micro_batch")), 8)
    ref = reference(workers(1), model, micro_batch=micro)
    result = workers(world).run(run_layout, [*TINY, *model, *parallel])
    assert_parity(merged(result) if pipelined(parallel) else result[0], ref)


def assert_parity(result: dict[str, Any], ref: dict[str, Any]) -> None:
    """Step-1 gradients first, then every step's loss: a wrong gradient is named with its error (a
    norm's 40% moved the third step's loss by 2e-5, and AdamW's updates hide more)."""
    assert result["grads"].keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        got = result["grads"][name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = (got - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= GRAD_RTOL, f"{name}: relative L2 error {err:.2e}"
    assert_losses_match(result["rows"], ref["rows"])
