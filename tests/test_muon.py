"""Muon (issue 49): which parameters it trains, exactly torch.optim.Muon with torch.optim.AdamW on one
device, each data-parallel layout exact against one device in losses and weights, the bytes of its
ownership exchange, and bad settings refused."""

from __future__ import annotations

import re
import shutil
from typing import Any

import pytest
import torch
from torch import nn

from meshtron.checkpoint.save_load import CheckpointError
from meshtron.comm.workers import WorkerPool
from meshtron.config.optimizer import is_muon_matrix
from meshtron.config.schema import ConfigError
from meshtron.plan.muon import assign_owners, newton_schulz_flops
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import assert_losses_match, relative, train_rows, trainer_for
from meshtron.testing.tiny import MOE, TINY
from meshtron.train.optim import build_optimizer

MUON = ["--training.optimizer=muon", "--training.weight_decay=0.1"]
# Layouts sum gradients in another order (fp32 rounding); bf16 Newton-Schulz rounds those 1e-7 apart to
# 2^-8 apart, so layouts are compared with fp32 Newton-Schulz, and bf16's spread is bounded separately.
FP32_NS = [*MUON, "--training.muon_ns_dtype=fp32"]
STEPS = 4


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest():
    assert is_muon_matrix("layers.0.attention.wq.weight", 2)
    assert is_muon_matrix("layers.3.moe.experts.w2", 3)  # E matrices
    assert is_muon_matrix("layers.1.moe.shared_experts.w1.weight", 2)
    assert is_muon_matrix("mtp.0.block.feed_forward.w3.weight", 2)
    for name, ndim in [
        ("tok_embeddings.weight", 2),
        ("output.weight", 2),
        ("layers.0.attention_norm.weight", 1),
        ("layers.0.moe.router.weight", 2),
        ("layers.0.moe.shared_gate.weight", 2),
        ("mtp.0.eh_proj.weight", 2),
        ("norm.weight", 1),
    ]:
        assert not is_muon_matrix(name, ndim), name


def test_owners_balance_newton_schulz_work():
    shapes = [(64, 64), (32, 64), (32, 64), (96, 64), (64, 96), (64, 64)]
    owners = assign_owners(shapes, 2, steps=5)
    load = [
        sum(newton_schulz_flops(*s, 5) for s, o in zip(shapes, owners, strict=True) if o == r) for r in (0, 1)
    ]
    assert set(owners) == {0, 1} and max(load) <= 1.25 * min(load)


class TorchReference:
    """torch.optim.Muon on the block matrices (an expert stack as E 2-D views) and AdamW on the rest."""

    def __init__(self, trainer: Any, t: Any):
        muon, rest, self.views = [], [], []
        for entry in trainer.engine.owned_rows():
            if not is_muon_matrix(entry.name, entry.param.ndim):
                rest.append(entry.param)
            elif entry.param.ndim == 2:
                muon.append(entry.param)
            else:
                for k in range(entry.param.shape[0]):
                    view = nn.Parameter(entry.param.data[k])
                    self.views.append((view, entry.param, k))
                    muon.append(view)
        self.muon = torch.optim.Muon(
            muon, lr=t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum, nesterov=t.muon_nesterov,
            ns_steps=t.muon_ns_steps, adjust_lr_fn=t.muon_adjust_lr,
        )  # fmt: skip
        self.adamw = build_optimizer(rest, t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay)
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.state = {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        for view, whole, k in self.views:
            view.grad = whole.grad[k]
        self.adamw.step()
        self.muon.step()


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {e.name: e.param.detach().clone() for e in trainer.engine.owned_rows()}


@pytest.mark.parametrize("model", [[], MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_one_device_is_torch_muon_with_adamw(model, rule):
    """The same steps, bit for bit: meshtron's Muon, and torch's Muon and AdamW on the same split."""
    overrides = [*TINY, *model, *MUON, f"--training.muon_adjust_lr={rule}", "--training.grad_clip=0.5"]
    ours = trainer_for(overrides)
    theirs = trainer_for(overrides)
    theirs.job.optimizer = TorchReference(theirs, theirs.cfg.training)
    for step in range(STEPS):
        a, b = ours.step(step), theirs.step(step)
        assert a["loss"] == b["loss"], (step, a["loss"], b["loss"])
    for name, w in _weights(theirs).items():
        assert torch.equal(_weights(ours)[name], w), name


def test_muon_moves_the_weights_unlike_adamw():
    """The optimizer key is live: Muon and AdamW part after the first update."""
    adamw = trainer_for([*TINY]).run()
    muon = trainer_for([*TINY, *MUON]).run()
    assert adamw[0]["loss"] == muon[0]["loss"] and relative(adamw[-1]["loss"], muon[-1]["loss"]) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["--training.muon_adjust_lr=rms"],
            "training.muon_adjust_lr='rms' is not one of match_rms_adamw, original",
        ),
        (["--training.muon_ns_steps=0"], "training.muon_ns_steps=0 must be between 1 and 99"),
        (["--training.optimizer=sgd"], "training.optimizer='sgd' is not one of adamw, muon"),
        (["--training.muon_momentum=1.0"], "training.muon_momentum=1.0 must be in [0, 1)"),
    ],
)
def test_bad_muon_settings_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check(load_config(None, [*TINY, *MUON, *overrides]))


# Distributed: losses every step and every weight at the end, against the one-device run.
def _muon_run(overrides: list[str]) -> dict[str, Any]:
    trainer = trainer_for(overrides)
    with trainer.comm.recording() as recorded:
        rows = [trainer.step(step) for step in range(STEPS)]
    # Each logical parameter whole: the engine's own gather of what every rank owns, fed the weights.
    for entry in trainer.engine.owned_rows():
        entry.param.grad = entry.param.detach().clone()
    weights = trainer.engine.full_gradients(trainer.comm)
    if trainer.parallel.tp_plan is not None:
        weights = trainer.parallel.tp_plan.gather_full(weights, trainer.comm)
    return {"rows": rows, "weights": weights, "muon_bytes": recorded.stats.total_bytes(op="all_to_all")}


_ONE_DEVICE: dict[tuple[str, ...], dict[str, Any]] = {}


def _one_device(pool: WorkerPool, model: list[str], micro: int) -> dict[str, Any]:
    key = (*model, str(micro))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = pool.run(_muon_run, [*TINY, *FP32_NS, *model, f"--training.micro_batch={micro}"])[
            0
        ]
    return _ONE_DEVICE[key]


HALF, QUARTER = "--training.micro_batch=4", "--training.micro_batch=2"
LAYOUTS = {
    "ddp": (2, [], ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", HALF]),
    "zero1": (2, [], ["--parallel.dp_shard=2", "--parallel.zero=1", HALF]),
    "zero2": (2, [], ["--parallel.dp_shard=2", "--parallel.zero=2", HALF]),
    "zero2_small_buckets": (2, [], ["--parallel.dp_shard=2", "--parallel.zero=2", "--parallel.bucket_mb=0.01", HALF]),
    "zero3": (2, [], ["--parallel.dp_shard=2", "--parallel.zero=3", HALF]),
    "simple_fsdp": (2, [], ["--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.fsdp_impl=simple", HALF]),
    "hsdp": (4, [], ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=3", QUARTER]),
    "zero1_ep2": (2, MOE, ["--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.ep=2", "--training.micro_batch=4"]),
    "tp2_sp": (2, [], ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp2_zero1_small_buckets": (4, [], ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.bucket_mb=0.01", HALF]),
    "tp2_zero3_ddp_replicas": (4, [], ["--parallel.tp=2", "--parallel.dp_replicate=2", HALF]),
    "moe_tp2_ep2_zero2": (4, MOE, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.zero=2", "--parallel.ep=2", HALF]),
    "moe_folded_tp2_ep2": (2, MOE, ["--parallel.tp=2", "--parallel.ep=2", "--parallel.etp=1"]),
    "mla_tp2_sp": (2, ["--model.name=tiny-deepseek"], ["--parallel.tp=2", "--parallel.sp=true"]),
}  # fmt: skip


@pytest.mark.parametrize("case", LAYOUTS)
def test_each_data_parallel_layout_trains_as_one_device(workers, case):
    world, model, layout = LAYOUTS[case]
    # MoE's balance loss is a statistic of each micro-batch: its reference groups sequences alike
    given = [int(x.split("=")[1]) for x in layout if x.startswith("--training.micro_batch")]
    micro = given[0] if model and given else 8
    ref = _one_device(workers(1), model, micro)
    got = workers(world).run(_muon_run, [*TINY, *FP32_NS, *model, *layout])[0]
    for a, b in zip(got["rows"], ref["rows"], strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    for name, want in ref["weights"].items():
        err = (got["weights"][name] - want).norm() / want.norm()
        assert err <= 1e-5, f"{case}: {name} relative error {err:.2e}"


def test_pipeline_and_context_parallel_train_as_one_device(workers):
    """Each pipeline stage orthogonalizes its own matrices; context-parallel ranks shard like dp."""
    ref = _one_device(workers(1), [], 8)
    for world, layout in [
        (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=1", QUARTER]),
        (4, ["--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.zero=2", HALF]),
    ]:
        results = workers(world).run(_muon_run, [*TINY, *FP32_NS, *layout])
        weights = {name: w for r in results for name, w in r["weights"].items()}
        for a, b in zip(results[-1]["rows"], ref["rows"], strict=True):
            assert relative(a["loss"], b["loss"]) <= 1e-5, (layout, a["step"], a["loss"], b["loss"])
        for name, want in ref["weights"].items():
            assert (weights[name] - want).norm() / want.norm() <= 1e-5, (layout, name)


FOUR_LAYERS = ["--model.n_layers=4"]
SCHEDULES = {
    "interleaved": ["--parallel.pp_schedule=interleaved", "--parallel.vpp=2"],
    "zero_bubble": ["--parallel.pp_schedule=zero_bubble"],
    "dualpipev": ["--parallel.pp_schedule=dualpipev", "--parallel.vpp=2", "--training.micro_batch=1"],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_family_trains_as_one_device(workers, schedule):
    """The optimizer runs after the schedule's last action: interleaved, split-backward and V placements
    each orthogonalize their chunks' matrices as one device does (pp 2 x ZeRO-1 dp 2)."""
    ref = _one_device(workers(1), FOUR_LAYERS, 8)
    layout = ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=1", QUARTER, *SCHEDULES[schedule]]
    results = workers(4).run(_muon_run, [*TINY, *FP32_NS, *FOUR_LAYERS, *layout])
    weights = {name: w for r in results for name, w in r["weights"].items()}
    for a, b in zip(results[0]["rows"], ref["rows"], strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-5, (schedule, a["step"], a["loss"], b["loss"])
    for name, want in ref["weights"].items():
        assert (weights[name] - want).norm() / want.norm() <= 1e-5, (schedule, name)


def test_bf16_newton_schulz_spreads_layouts_by_bf16_rounding(workers):
    """With torch's bf16 Newton-Schulz, ZeRO-2's weights after 4 steps are within 1% of one device's
    (fp32 sums in another order, rounded to bf16 at the iteration's input), and the losses within 1e-3."""
    ref = workers(1).run(_muon_run, [*TINY, *MUON])[0]
    got = workers(2).run(_muon_run, [*TINY, *MUON, "--parallel.dp_shard=2", "--parallel.zero=2", HALF])[0]
    for a, b in zip(got["rows"], ref["rows"], strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-3
    worst = max(float((got["weights"][n] - w).norm() / w.norm()) for n, w in ref["weights"].items())
    assert worst <= 1e-2


def test_exchange_moves_each_matrix_to_its_owner_and_back(workers):
    """Bytes each rank sends per step, in bf16. ZeRO-2 on 2 ranks (row blocks of ceil(r/2) rows): its
    rows of the matrices the other rank owns, then the other rank's rows of those it owns. DDP: each
    matrix it owns, whole, to the other rank."""
    shapes = {n: tuple(p.shape) for n, p in trainer_for([*TINY]).model.named_parameters()}
    names = [n for n, s in shapes.items() if is_muon_matrix(n, len(s))]
    matrices = [shapes[n] for n in names]
    owners = assign_owners(matrices, 2, steps=5, keys=names)

    def rows_held(rows: int, rank: int) -> int:
        return min(-(-rows // 2), rows) if rank == 0 else rows - (-(-rows // 2))

    for layout in (["--parallel.dp_shard=2", "--parallel.zero=2"], ["--parallel.dp_replicate=2"]):
        for me, result in enumerate(workers(2).run(_muon_run, [*TINY, *MUON, *layout, HALF])):
            if "--parallel.dp_replicate=2" in layout:
                sent = sum(r * c for (r, c), o in zip(matrices, owners, strict=True) if o == me)
            else:
                other = 1 - me
                sent = sum(
                    (rows_held(r, me) if o == other else rows_held(r, other)) * c
                    for (r, c), o in zip(matrices, owners, strict=True)
                )
            assert result["muon_bytes"] == STEPS * sent * 2, (layout, me)


def test_checkpoint_carries_the_momentum_across_layouts(workers, tmp_path):
    """Saved under ZeRO-3 on 4 ranks after 3 steps; resumed on pp 2 x ZeRO-1, tp 2 x pp 2 and on one device, each
    continues as the uninterrupted run does: the momentum is saved in the rows the weights are."""
    base = [*TINY, *FP32_NS, "--training.steps=6", "--checkpoint.every=3", "--checkpoint.keep=1"]
    zero3 = ["--parallel.dp_shard=4", "--parallel.zero=3", QUARTER]
    straight = workers(4).run(train_rows, [*base, *zero3, f"--run.dir={tmp_path / 'straight'}"])[0]
    workers(4).run(train_rows, [*base, *zero3, "--training.steps=3", f"--run.dir={tmp_path / 'first'}"])
    for name, world, layout in [
        ("pp2_zero1", 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=1", QUARTER]),
        ("tp2_pp2", 4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp_shard=1", QUARTER]),
        ("single", 1, []),
    ]:
        shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / name / "checkpoints")
        resumed = workers(world).run(
            train_rows, [*base, *layout, "--checkpoint.resume=true", f"--run.dir={tmp_path / name}"]
        )[0]
        assert_losses_match(resumed, straight[3:])


def test_switching_optimizer_on_resume_is_refused(tmp_path):
    base = [*TINY, "--training.steps=1", "--checkpoint.every=1", f"--run.dir={tmp_path}"]
    trainer_for([*base, *MUON]).run()
    with pytest.raises(
        CheckpointError, match="was written with training.optimizer='muon', and this run has 'adamw'"
    ):
        trainer_for([*base, "--training.steps=2", "--checkpoint.resume=true"]).run()


@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        ("fp8", ["--parallel.tp=2", "--parallel.sp=true"]),
        ("bf16", ["--parallel.dp_shard=2", "--parallel.zero=3", HALF]),
    ],
)
def test_float8_and_bf16_track_one_device(workers, dtype, layout):
    """Low-precision compute rounds differently in each layout; Muon's steps track the one-device run
    of the same dtype within 1% in loss (as AdamW's do: tests/test_float8.py)."""
    run = [*TINY, *FP32_NS, f"--training.dtype={dtype}"]
    want = workers(1).run(_muon_run, run)[0]
    got = workers(2).run(_muon_run, [*run, *layout])[0]
    for a, b in zip(got["rows"], want["rows"], strict=True):
        assert relative(a["loss"], b["loss"]) <= 1e-2, (dtype, a["step"], a["loss"], b["loss"])


def test_the_planner_prices_muon_and_dry_run_shows_it(capsys):
    """State: one fp32 momentum per matrix element (plan/state.py, exact in tests/test_plan.py); work:
    a rank's 1/(n·tp) of the dense matrices' Newton-Schulz FLOPs; the dry run names both."""
    from meshtron.commands.main import main
    from meshtron.plan.muon import newton_schulz_work
    from meshtron.plan.state import rank_parameters

    cfg = load_config(None, [*TINY, *MUON, "--parallel.dp_shard=2", "--parallel.tp=2"])
    whole = load_config(None, [*TINY, *MUON])
    matrices = [x.shape for x in rank_parameters(whole) if is_muon_matrix(x.name, len(x.shape))]
    flops = sum(newton_schulz_flops(*shape, 5) for shape in matrices)
    assert newton_schulz_work(cfg) == pytest.approx(flops / 4)
    main(["train", "--config", "configs/demo.toml", "--dry-run", "--training.optimizer=muon"])
    out = capsys.readouterr().out
    assert "\n  muon   " in out and "muon               Newton-Schulz" in out
