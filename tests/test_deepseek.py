"""DeepSeek-V3's architecture against transformers' DeepseekV3ForCausalLM, the independent reference:
multi-head latent attention (q and kv latents, the shared rotary key, YaRN, interleaved rotary pairs),
its routing (sigmoid scores, a correction bias, group-limited top-k, scaled gates, shared experts, the
first layer dense). A tiny random checkpoint's first loss through `model.init_from` equals the loss
transformers computes on the same batch within 1e-5 in every layout; the export loads back into
transformers with the same greedy tokens; decoding caches the latents."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from meshtron import hf
from meshtron.data.dataset import PreparedData, prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.models.generate import generate
from meshtron.models.llama import KVCache, build_model
from meshtron.rules.checks import load_config
from meshtron.testing.parity import (
    assert_layout_trains_as_one_device,
    assert_losses_match,
    relative,
    train_rows,
    trainer_for,
)
from meshtron.testing.tiny import ONE_STEP, ONE_STEP_BATCH, ONE_STEP_SEQ, TINY, perturb

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 263, ONE_STEP_SEQ, ONE_STEP_BATCH
TRAINING = ONE_STEP
# 4 layers (the first dense), 4 heads, q and kv latents, 8 experts in 4 groups, top-4 from the best 2,
# YaRN at 4x over 16 positions (the training windows of 32 are in the stretched range).
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16,
    q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
    num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0},
)  # fmt: skip


def deepseek_model(**changes: Any) -> torch.nn.Module:
    """A tiny DeepseekV3ForCausalLM with weights on the scale of a trained one, and a correction bias
    that changes which experts are chosen."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**CONFIG, **changes})
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    perturb(model, seed=1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(2)))
    return model


@torch.no_grad()
def transformers_loss(model: torch.nn.Module, data: Path) -> float:
    """The mean cross-entropy transformers computes on the trainer's first global batch."""
    dataset = PreparedData.open(data)
    inputs, targets = BatchSampler(dataset.n_tokens, SEQ, BATCH, seed=0).rank_batch(dataset, 0, 0, 1)
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("deepseek")
    text = root / "text.txt"
    text.write_text(" ".join(f"w{(i * 7919) % 1009}" for i in range(6000)))
    prepare_data([text], root / "data", tokenizer="byte")
    model = deepseek_model()
    model.save_pretrained(root / "hf")
    return {
        "path": root / "hf",
        "data": root / "data",
        "model": model,
        "loss": transformers_loss(model, root / "data"),
    }


def first_loss(overrides: list[str]) -> float:
    trainer = trainer_for(overrides)
    try:
        return trainer.step(0)["loss"]
    finally:
        trainer.close()


LAYOUTS = {
    "one_device": (1, []),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "ep2": (2, ["--parallel.ep=2"]),
    "ep2_over_cp2": (2, ["--parallel.ep=2", "--parallel.cp=2", "--parallel.dp_shard=1"]),
    # 4 groups on 4 ranks: each token sent once to each of its (at most 2) groups' ranks
    "ep4_dedup": (4, ["--parallel.ep=4", "--parallel.ep_dispatch=dedup"]),
    "pp2_1f1b": (2, ["--parallel.pp=2"]),
    "pp2_interleaved": (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.vpp=2"]),
    "pp2_zero_bubble": (2, ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble"]),
    "pp2_dualpipev": (2, ["--parallel.pp=2", "--parallel.pp_schedule=dualpipev"]),
    "cp2_ring": (2, ["--parallel.cp=2"]),
    "cp2_allgather": (2, ["--parallel.cp=2", "--parallel.cp_impl=allgather"]),
    "cp2_alltoall": (2, ["--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "cp4_hybrid": (4, ["--parallel.cp=4", "--parallel.cp_impl=hybrid", "--parallel.cp_ulysses=2"]),
    "zero3": (2, ["--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=2"]),
    "compiled": (1, ["--training.compile=true"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_loss_in_every_layout_is_transformers(workers, checkpoint, layout, tmp_path):
    world, parallel = LAYOUTS[layout]
    overrides = [f"--model.init_from={checkpoint['path']}", f"--data.path={checkpoint['data']}", *TRAINING]
    overrides += [f"--run.dir={tmp_path}", *parallel]
    pool = workers(world)
    with pool.waiting_up_to(600):
        losses = pool.run(first_loss, overrides)
    assert relative(losses[0], checkpoint["loss"]) <= 1e-5, (losses, checkpoint["loss"])


def test_logits_routing_and_export_equal_transformers(checkpoint, tmp_path):
    """The loaded model's logits equal transformers' (1e-5), its export loads back into transformers
    with the same logits, and greedy decoding through the latent cache gives transformers' tokens."""
    reference = checkpoint["model"]
    ours = hf.load(checkpoint["path"])
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(tokens).logits
        assert (ours(tokens) - want).abs().max() <= 1e-5 * want.abs().max()
    hf.save(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").float().eval()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)
    prompt = tokens[:1, :8]
    theirs = back.generate(prompt, max_new_tokens=12, do_sample=False)[0, 8:].tolist()
    assert generate(ours, prompt[0].tolist(), max_new_tokens=12)[0].tolist() == theirs


def test_the_decoding_cache_holds_latents():
    """Per token and layer, the cache holds the latent and the rotary key (16 + 8 values), not every
    head's keys and values (4 · (24 + 12)); decoding through it gives the full forward's logits."""
    ours = build_model(load_config(None, ["--model.name=tiny-deepseek"]).model, seed=0)
    cfg = ours.cfg
    cache = KVCache(cfg, 2, 32)
    assert cache.token_bytes == cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        parts = [ours(tokens[:, a:b], cache=cache) for a, b in ((0, 9), (9, 12), (12, 20))]
        full = ours(tokens)
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-5 * full.abs().max()


# Training with latent attention against one device: losses of 4 steps and step-1 gradients (tolerances in
# testing/parity.py), each layout composing MLA with what touches attention's internals.
DEEPSEEK = ["--model.name=tiny-deepseek"]
PARITY = {
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2_sp_selective": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=selective"]),
    "tp2_sp_full_q": (2, ["--model.q_lora_rank=0", "--parallel.tp=2", "--parallel.sp=true"]),
    "tp2_sp_op_recompute": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=op"]),
    # DeepSeek-V3's recompute: every matmul's output kept but the up-projections'
    "tp2_op_recompute_up_projections": (2, ["--parallel.tp=2", "--training.recompute=op",
                                            "--training.op_recompute_saves=matmuls_but_mla_up"]),
    "cp2_ring_full_recompute": (2, ["--parallel.cp=2", "--training.recompute=full"]),
    "cp2_alltoall_x_tp2": (4, ["--parallel.cp=2", "--parallel.cp_impl=alltoall", "--parallel.tp=2"]),
    "zero2_x_ep2": (2, ["--parallel.zero=2", "--parallel.ep=2", "--training.micro_batch=4"]),
    "simple_fsdp2": (2, ["--parallel.fsdp_impl=simple", "--training.micro_batch=4"]),
    "pp2_zbv_ep2": (4, ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--parallel.ep=2",
                        "--model.n_layers=4", "--parallel.zero=1", "--training.micro_batch=2"]),
    # The latents travel instead of the keys and values (parallel/context_latent.py)
    "cp2_ring_latent": (2, ["--parallel.cp=2", "--parallel.cp_exchange=latent"]),
    "cp2_allgather_latent_zero3_op_recompute_up_projections": (2, ["--parallel.cp=2", "--parallel.cp_impl=allgather",
        "--parallel.cp_exchange=latent", "--training.micro_batch=4", "--training.recompute=op",
        "--training.op_recompute_saves=matmuls_but_mla_up"]),
    "cp2_ring_latent_x_tp2_sp": (4, ["--parallel.cp=2", "--parallel.cp_exchange=latent", "--parallel.tp=2",
                                     "--parallel.sp=true", "--training.recompute=selective"]),
    "cp4_ring_latent_full_recompute": (4, ["--parallel.cp=4", "--parallel.cp_exchange=latent",
                                           "--training.recompute=full"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PARITY))
def test_latent_attention_trains_as_one_device(workers, case):
    world, layout = PARITY[case]
    assert_layout_trains_as_one_device(workers, DEEPSEEK, world, layout)


def test_float8_latent_attention_tracks_one_device(workers, tmp_path):
    """fp8 projections (MLA's down- and up-projections too) under tp 2 + sp, where the down-projections
    see each rank's tokens: losses track the one-device float8 run (bf16 compute: 1e-2)."""
    fp8 = [*TINY, *DEEPSEEK, "--training.dtype=fp8", "--training.steps=3", "--training.micro_batch=8"]
    want = workers(1).run(train_rows, [*fp8, f"--run.dir={tmp_path / 'one'}"])[0]
    layout = ["--parallel.tp=2", "--parallel.sp=true", f"--run.dir={tmp_path / 'tp'}"]
    assert_losses_match(workers(2).run(train_rows, [*fp8, *layout])[0], want, rtol=1e-2)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents of 2-6 words, so that every 32-token window holds several."""
    root = tmp_path_factory.mktemp("documents")
    generator = torch.Generator().manual_seed(1)
    words = ["latent", "rotary", "expert", "group", "token", "head"]
    lines = []
    for _ in range(600):
        picks = torch.randint(0, len(words), (int(torch.randint(2, 7, (1,), generator=generator)),))
        lines.append(json.dumps({"text": " ".join(words[i] for i in picks.tolist())}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_data([root / "docs.jsonl"], root / "prepared", tokenizer="byte")
    return root / "prepared"


@pytest.mark.parametrize("impl", ["ring", "allgather"])
@pytest.mark.parametrize("exchange", ["kv", "latent"])
def test_documents_over_context_parallel_latent_attention(workers, tmp_path, short_documents, impl, exchange):
    """Attention within documents over cp 2, MLA's keys and values (of different head sizes) or its
    latents exchanged."""
    base = [*TINY, *DEEPSEEK, f"--data.path={short_documents}", "--training.steps=3", "--run.sample_tokens=0"]
    want = workers(1).run(train_rows, [*base, "--data.document_mask=true", f"--run.dir={tmp_path / 'one'}"])[
        0
    ]
    plain = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'plain'}"])[0]
    assert abs(want[-1]["loss"] - plain[-1]["loss"]) > 1e-3  # the mask changes what is computed
    layout = ["--data.document_mask=true", "--parallel.cp=2", f"--parallel.cp_impl={impl}"]
    layout += [f"--parallel.cp_exchange={exchange}", f"--run.dir={tmp_path / impl}"]
    rows = workers(2).run(train_rows, [*base, *layout])[0]
    assert_losses_match(rows, want)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A tiny DeepSeek-V3 with one multi-token prediction module, exported as DeepSeek ships it (layer
    num_hidden_layers with enorm, hnorm, eh_proj, shared_head and a decoder layer)."""
    cfg = load_config(None, ["--model.name=tiny-deepseek", "--model.mtp_depth=1", "--model.vocab_size=263"])
    model = build_model(cfg.model, seed=0)
    perturb(model, seed=5)
    path = tmp_path_factory.mktemp("deepseek_mtp") / "hf"
    hf.save(model, path)
    return {"path": path, "model": model, "data": checkpoint["data"]}


def first_step_state(overrides: list[str]) -> dict[str, Any]:
    """The MTP module's initial weights (one device), and the first step's losses."""
    trainer = trainer_for(overrides)
    try:
        named = trainer.job.model.named_parameters()
        initial = {n: p.detach().clone() for n, p in named if n.startswith("mtp.")}
        row = trainer.step(0)
        return {"loss": row["loss"], "mtp_loss": row.get("mtp_loss"), "mtp": initial}
    finally:
        trainer.close()


def test_mtp_module_loads_from_where_deepseek_ships_it(workers, mtp_checkpoint, tmp_path):
    """init_from with mtp_depth=1 reads layer num_hidden_layers into the MTP module (one device: every
    MTP weight equal to the exported one; pp 2: the same first MTP loss); without mtp_depth the module is
    skipped, and transformers loads the export (its layers past num_hidden_layers ignored)."""
    base = [f"--model.init_from={mtp_checkpoint['path']}", f"--data.path={mtp_checkpoint['data']}", *TRAINING]
    one = workers(1).run(first_step_state, [*base, "--model.mtp_depth=1", f"--run.dir={tmp_path / 'one'}"])[0]
    exported = dict(mtp_checkpoint["model"].named_parameters())
    assert one["mtp"] and all(torch.equal(p, exported[n].detach()) for n, p in one["mtp"].items())
    pp = [*base, "--model.mtp_depth=1", "--parallel.pp=2", f"--run.dir={tmp_path / 'pp'}"]
    assert relative(workers(2).run(first_step_state, pp)[-1]["mtp_loss"], one["mtp_loss"]) <= 1e-5
    plain = workers(1).run(first_step_state, [*base, f"--run.dir={tmp_path / 'plain'}"])[0]
    assert plain["mtp_loss"] is None and relative(plain["loss"], one["loss"]) <= 1e-6
    back = transformers.AutoModelForCausalLM.from_pretrained(mtp_checkpoint["path"]).float().eval()
    tokens = torch.randint(0, 263, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (back(tokens).logits - mtp_checkpoint["model"](tokens)).abs().max() <= 1e-4


def test_generate_says_the_cache_per_token():
    """DeepSeek-V3 keeps 576 values a token and layer (70,272 bytes over 61 layers in bf16), Llama 3 8B
    its 8 key/value heads' keys and values (131,072 bytes over 32 layers)."""
    from meshtron.commands.export import cache_line

    v3 = load_config(None, ["--model.name=deepseek-v3"]).model
    llama = load_config(None, ["--model.name=llama3-8b"]).model
    assert "70,272 bytes per token" in cache_line(v3, torch.bfloat16)
    assert "131,072 bytes per token" in cache_line(llama, torch.bfloat16)


def test_routing_balance_loss_and_bias_step_are_deepseek_v3s():
    """Against transformers' DeepseekV3TopkRouter (the chosen experts and their gates), and against the
    report's formulas where transformers has none: the sequence-wise balance loss α·Σᵢ fᵢ·Pᵢ with
    fᵢ = E/(K·T)·(tokens choosing i), Pᵢ the mean of sᵢ/Σⱼsⱼ over the sequence, averaged over sequences;
    the bias step bᵢ += γ·sign(mean load − loadᵢ), kept centred (which changes no choice)."""
    from meshtron.models.moe import Router, router_losses

    cfg = load_config(None, ["--model.name=tiny-deepseek"]).model
    gen = torch.Generator().manual_seed(7)
    ours = Router(cfg)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(ours.weight.shape, generator=gen))
        ours.expert_bias.copy_(0.3 * torch.randn(cfg.n_experts, generator=gen))
    config = transformers.DeepseekV3Config(**{**CONFIG, "hidden_size": cfg.dim, "n_routed_experts": 8})
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(ours.expert_bias)
    B, S = 3, 16
    x = torch.randn(B * S, cfg.dim, generator=gen)
    weights, experts, scores, logits = ours(x)
    _, their_weights, their_experts = theirs(x)
    ours_sorted, order = experts.sort(dim=-1)
    assert torch.equal(ours_sorted, their_experts.sort(dim=-1).values)
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_experts.argsort(-1)))
    balance, _ = router_losses(scores, experts, logits, "sigmoid", n_sequences=B)
    E, K = cfg.n_experts, cfg.top_k
    chosen = torch.zeros(B * S, E).scatter_(1, experts, 1.0).view(B, S, E)
    f = E / (K * S) * chosen.sum(1)
    P = (scores / scores.sum(-1, keepdim=True)).view(B, S, E).mean(1)
    torch.testing.assert_close(balance, (f * P).sum(-1).mean())
    load = chosen.sum((0, 1))
    before = ours.expert_bias.clone()
    ours.update_bias(load)
    step = before + cfg.router_bias_rate * torch.sign(load.mean() - load)
    torch.testing.assert_close(ours.expert_bias, step - step.mean())
