"""Real model sizes start: the model is built on the meta device, parallelized, and each rank materialises
and initialises only what it holds, with the single-device initialisation's values, shard by shard."""

from __future__ import annotations

import random

import pytest
import torch

from meshtron.models.init import init_region
from meshtron.models.llama import build_meta_model, build_model
from meshtron.parallel.regions import held_rows, local_rows, logical_region
from meshtron.rules.checks import load_config
from meshtron.testing.parity import trainer_for
from meshtron.testing.tiny import MOE, TINY


@pytest.mark.parametrize("seed", range(6))
def test_any_region_of_the_initialisation_is_the_whole_tensor_sliced(seed):
    """init_region draws a region without the rest, and it is that region of the whole tensor: over
    random shapes (1-3 dims, rows wider and narrower than a block) and random boxes."""
    rng = random.Random(seed)
    cfg = load_config(None, TINY).model
    shape = tuple(rng.choice([1, 3, 17, 40, 700, 5000]) for _ in range(rng.randint(1, 3)))
    name = rng.choice(["layers.0.attention.wq.weight", "layers.1.moe.experts.w2", "tok_embeddings.weight"])
    whole = init_region(name, shape, [(0, n) for n in shape], cfg, seed)
    assert whole.shape == shape and whole.abs().sum() > 0
    for _ in range(5):
        region = [tuple(sorted(rng.sample(range(n + 1), 2))) for n in shape]
        part = init_region(name, shape, region, cfg, seed)
        assert torch.equal(part, whole[tuple(slice(a, b) for a, b in region)]), (shape, region)


def test_constants_and_the_residual_scale():
    cfg = load_config(None, TINY).model
    assert torch.equal(init_region("layers.0.ffn_norm.weight", (8,), [(2, 5)], cfg, 0), torch.ones(3))
    assert torch.equal(init_region("layers.0.attention.wq.bias", (8,), [(0, 8)], cfg, 0), torch.zeros(8))
    wq = init_region("layers.0.attention.wq.weight", (256, 256), [(0, 256), (0, 256)], cfg, 0)
    wo = init_region("layers.0.attention.wo.weight", (256, 256), [(0, 256), (0, 256)], cfg, 0)
    assert abs(wq.std() / wo.std() - (2 * cfg.n_layers) ** 0.5) < 0.05


def test_a_meta_build_holds_no_parameter_storage():
    model = build_meta_model(load_config(None, [*TINY, *MOE]).model)
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope_inv_freq.is_meta and not model.layers["0"].moe.loads_2E.is_meta


def held_regions_match_single_device(overrides: list[str]) -> int:
    """On every rank: each region of each parameter this rank holds (after set-up: a meta build,
    parallelize, the seeded initialisation) equals that region of the single-device model's; the
    module parameters the engine keeps whole equal the whole tensors too. Returns the regions checked."""
    trainer = trainer_for(overrides)
    parallel, cfg = trainer.parallel, trainer.cfg
    single = dict(build_model(cfg.model, seed=cfg.training.seed).named_parameters())
    ep = trainer.job.place.mesh.group("ep")
    experts = {n for n in single if ".experts." in n} if ep.size > 1 else set()
    checked = 0
    for entry in parallel.engine.owned_rows():
        target, box, shape = local_rows(entry)
        where = (ep.rank, ep.size) if entry.name in experts else None
        region, logical = logical_region(entry.name, shape, box, parallel.tp_plan, where)
        assert logical == tuple(single[entry.name].shape), entry.name
        want = single[entry.name].detach()[tuple(slice(a, b) for a, b in region)]
        rows = held_rows(target, region)
        got = target[:rows].reshape(want.shape)
        assert torch.equal(got.float(), want), f"{entry.name} {region}"
        assert not target[rows:].any(), f"{entry.name}: padding rows not zero"
        checked += 1
    return checked


LAYOUTS = {
    "single": (1, []),
    "ddp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"]),
    "zero1_2": (2, ["--parallel.zero=1"]),
    "zero2_2": (2, ["--parallel.zero=2"]),
    "zero3_2": (2, ["--parallel.zero=3"]),
    "fully_shard_2": (2, ["--parallel.fsdp_impl=torch"]),
    "simple_fsdp_2": (2, ["--parallel.fsdp_impl=simple"]),
    "tp2_sp_vocab_padded": (2, ["--parallel.tp=2", "--parallel.sp=true", "--model.vocab_size=301"]),
    "tp2_kv_replicated_zero3": (4, ["--parallel.tp=4", "--model.n_kv_heads=2", "--parallel.zero=3"]),
    "cp2_zero3": (2, ["--parallel.cp=2"]),
    "ep2_tp2_etp2": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=2"]),
    "ep2_tp2_etp1_zero1": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=1", "--parallel.zero=1"]),
    # One local expert over two expert-data-parallel ranks: each holds half of its matrices' rows.
    "ep2_edp2_experts_cut_within_zero3": (4, [*MOE, "--model.n_experts=2", "--parallel.ep=2"]),
    "experts_cut_within_simple_fsdp": (4, [*MOE, "--model.n_experts=2", "--parallel.fsdp_impl=simple"]),
    "pp2_tied": (2, ["--parallel.pp=2", "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "pp2_zbv_tied_zero3": (4, ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--model.n_layers=4",
                               "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "pp2_interleaved_tp2": (4, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.vpp=2",
                                "--model.n_layers=4", "--parallel.tp=2", "--training.micro_batch=1"]),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_holds_the_single_device_initialisation_of_its_regions(workers, layout):
    world, overrides = LAYOUTS[layout]
    checked = workers(world).run(
        held_regions_match_single_device, [*TINY, "--training.micro_batch=1", *overrides]
    )
    assert all(n > 0 for n in checked)
