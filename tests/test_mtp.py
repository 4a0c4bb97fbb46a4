"""Multi-token prediction (models/mtp.py): the loss is the report's formula, computed here independently on
shortened sequences; every layout trains as one device does, the shared embedding kept exact under
pipeline parallel; document and loss masks apply to each depth's targets."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from meshtron.data import IGNORE_INDEX
from meshtron.models.llama import build_model
from meshtron.models.loss import MicroBatchLoss, cross_entropy_per_token
from meshtron.models.mtp import depth_inputs
from meshtron.models.rope import rope_cos_sin
from meshtron.pictures.experts import _model_order, draw_expert_load
from meshtron.rules.checks import load_config
from meshtron.testing.parity import assert_layout_trains_as_one_device
from meshtron.testing.tiny import TINY, perturb

MTP = ["--model.mtp_depth=2", "--training.mtp_loss_coef=0.5"]


def test_depth_inputs_shift_the_whole_sequences():
    tokens = torch.arange(10, 18)[None]
    targets = tokens + 1
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    t_DBS, y_DBS = depth_inputs(tokens, targets, 2, docs)
    assert t_DBS[0, 0].tolist() == [11, 12, 13, 14, 15, 16, 17, 0]  # t_{i+1}; the last has none
    ignored = IGNORE_INDEX  # no token k places on, or that token in another document
    assert y_DBS[0, 0].tolist() == [12, 13, ignored, 15, 16, 17, ignored, ignored]
    assert y_DBS[1, 0].tolist() == [13, ignored, ignored, 16, 17, ignored, ignored, ignored]


@torch.no_grad()
def test_the_loss_is_the_reports_formula():
    """L = [Σ CE_main + λ/D · Σ_k Σ_i CE(t_{i+k+1} | h_k(i))] / T, with depth k run on the S − k positions
    that have a token k places on (written out here from the modules, without the shifts)."""
    cfg = load_config(None, [*TINY, *MTP]).model
    model = build_model(cfg, seed=0)
    perturb(model, seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    S, T, lam, D = 24, 48, 0.5, 2
    cos, sin = rope_cos_sin(model.rope_inv_freq, torch.arange(S).expand(2, -1), torch.float32)
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h, _ = block(h, cos, sin)
    want = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), targets.flatten(), reduction="sum")
    for k, module in enumerate(model.mtp.values(), start=1):
        n = S - k
        x = module.eh_proj(
            torch.cat([module.enorm(model.tok_embeddings(tokens[:, k:])), module.hnorm(h[:, :n])], -1)
        )
        h, _ = module.block(x, cos[:, :n], sin[:, :n])
        logits = model.output(module.norm(h))
        want += lam / D * F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten(), reduction="sum")
    mtp_tokens, mtp_targets = depth_inputs(tokens, targets, D)
    logits, aux = model(tokens, return_aux=True, mtp_tokens=mtp_tokens)
    loss = MicroBatchLoss(cross_entropy_per_token, T, contextlib.nullcontext, lam).for_step(None)
    total, ce = loss.of(logits, aux, targets, 0, mtp_targets)
    assert abs(total.item() - want.item() / T) <= 1e-6 * want.item() / T
    assert len(logits) == 1 + D


# name: (world, overrides): each composes the depths with a parallelism that touches them.
LAYOUTS = {
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "cp2_ring": (2, ["--parallel.cp=2"]),
    "zero3": (2, ["--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--training.micro_batch=2"]),
    "pp4_interleaved": (4, ["--parallel.pp=4", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved",
                            "--model.n_layers=8", "--training.micro_batch=2"]),
    "pp2_dualpipev_tied": (2, ["--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--model.n_layers=4",
                               "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "pp2_zero1_tp2": (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.zero=1", "--parallel.dp_shard=1",
                          "--training.micro_batch=2"]),
    "torch_fsdp2": (2, ["--parallel.dp_shard=2", "--parallel.fsdp_impl=torch", "--training.micro_batch=4"]),
    "simple_fsdp2_full_recompute": (2, ["--parallel.fsdp_impl=simple", "--parallel.dp_shard=2",
                                        "--training.recompute=full", "--training.micro_batch=4"]),
    "ep2_moe_op_recompute": (2, ["--model.name=tiny-moe", "--parallel.ep=2", "--training.recompute=op",
                                 "--training.micro_batch=4"]),
}  # fmt: skip


@pytest.mark.parametrize(("world", "layout"), LAYOUTS.values(), ids=list(LAYOUTS))
def test_every_layout_trains_as_one_device(workers, world, layout):
    assert_layout_trains_as_one_device(workers, MTP, world, layout)


def test_expert_load_picture_orders_the_mtp_blocks_after_the_layers(tmp_path):
    """An MoE model's MTP block reports its load as "mtp.0.block": the heat map takes it after the layers
    (it crashed reading the depth's name as a layer index)."""
    load = {"load": [3, 1], "imbalance": 1.5}
    rows = [{"step": s, "moe": {"mtp.0.block": load, "layers.10": load, "layers.2": load}} for s in (1, 2)]
    assert _model_order("layers.2") < _model_order("layers.10") < _model_order("mtp.0.block")
    assert draw_expert_load(rows, tmp_path / "expert-load.png", "t").exists()
