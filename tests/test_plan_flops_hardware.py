"""The planner's FLOPs count and hardware table (plan/flops.py, plan/hardware.py): fast and pure."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.config.schema import ConfigError, ModelConfig
from meshtron.models.llama import build_model
from meshtron.plan.flops import (
    executed_flops_per_token,
    keys_per_query,
    layer_flops,
    model_flops,
    recompute_flops_per_token,
    training_flops_per_token,
)
from meshtron.plan.hardware import ACCELERATORS, GiB, accelerator, peak_flops_per_s, with_links
from meshtron.rules.checks import load_config

SEQ = 128


def _matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights a token's forward multiplies with, routed-expert weights) of the real model: every
    matrix but the embedding lookup (the head counts, tied or not), and the routed experts among them."""
    model = build_model(cfg, seed=0)
    matrices = {n: p.numel() for n, p in model.named_parameters() if p.ndim >= 2}
    if not cfg.tie_embeddings:
        del matrices["tok_embeddings.weight"]
    routed = sum(v for n, v in matrices.items() if ".moe.experts." in n)
    return sum(matrices.values()), routed


@pytest.mark.parametrize(
    "overrides",
    [
        ["--model.name=tiny"],
        ["--model.name=tiny", "--model.tie_embeddings=true"],
        ["--model.name=tiny", "--model.qkv_bias=true", "--model.qk_norm=true"],  # biases and norms: no FLOPs
        ["--model.name=tiny", "--model.n_kv_heads=4"],  # multi-head attention
        ["--model.name=tiny", "--model.n_kv_heads=1", "--model.head_dim=32"],  # q width 128 != dim
        ["--model.name=tiny-moe"],
        ["--model.name=tiny-moe", "--model.tie_embeddings=true", "--model.dense_layers=[0]"],
    ],
)
def test_training_flops_are_six_times_active_params_plus_attention(overrides):
    cfg = load_config(None, overrides).model
    params, routed = _matmul_params(cfg)
    active = params - routed * (cfg.n_experts - cfg.top_k) // max(cfg.n_experts, 1)
    attention = 6 * cfg.n_layers * cfg.n_heads * cfg.head_size * SEQ  # 3 passes · 4·q·(s/2)
    assert training_flops_per_token(cfg, SEQ) == 6 * active + attention


@pytest.mark.parametrize("overrides", [[], ["--model.q_lora_rank=0"], ["--model.mtp_depth=2"]])
def test_latent_attention_and_mtp_flops_are_six_times_active_params_plus_attention(overrides):
    """MLA's projections and MTP's depths from the real model's matrices: the head runs 1 + D times; the
    core reads each head's Dk key and Dv value dims over s/2 keys (causal), in every block."""
    cfg = load_config(None, ["--model.name=tiny-deepseek", *overrides]).model
    params, routed = _matmul_params(cfg)
    active = params - routed * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    active += cfg.mtp_depth * cfg.dim * cfg.vocab_size  # the head again for each depth
    blocks = cfg.n_layers + cfg.mtp_depth
    core = 3 * 2 * cfg.n_heads * (cfg.head_size + cfg.v_head_dim) * SEQ / 2 * blocks
    assert training_flops_per_token(cfg, SEQ) == pytest.approx(6 * active + core, rel=1e-12)


def _gpt(h: int, layers: int, heads: int, vocab: int) -> ModelConfig:
    """A GPT block in meshtron's terms: MHA, SwiGLU of 8h/3 (3 matmuls of h·8h/3 = GELU's 2 of h·4h)."""
    assert 8 * h % 3 == 0
    return ModelConfig(dim=h, n_layers=layers, n_heads=heads, ffn_dim=8 * h // 3, vocab_size=vocab)


@pytest.mark.parametrize("h, layers, heads", [(6144, 32, 48), (12288, 96, 96), (768, 12, 12)])
def test_megatron_count_with_full_recompute(h, layers, heads):
    seq, vocab, batch = 4096, 131072, 3
    cfg = _gpt(h, layers, heads, vocab)
    megatron = 96 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    ours = batch * seq * executed_flops_per_token(cfg, seq, "full", attention="full")
    assert ours == pytest.approx(megatron, rel=1e-12)
    # Without recompute: 3 passes, 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)); causal halves attention only.
    no_recompute = 72 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    assert batch * seq * training_flops_per_token(cfg, seq, "full") == pytest.approx(no_recompute, rel=1e-12)
    causal = 72 * batch * seq * layers * h**2 * (1 + seq / (12 * h) + vocab / (12 * layers * h))
    assert batch * seq * training_flops_per_token(cfg, seq) == pytest.approx(causal, rel=1e-12)


def test_megatron_core_counter_for_a_gqa_swiglu_model():
    """Megatron-Core's num_floating_point_operations (3 passes, full attention, no recompute)."""
    cfg = load_config(None, ["--model.name=llama3-70b"]).model
    seq, batch, h, f, L, V = 8192, 2, cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    groups = cfg.kv_heads / cfg.n_heads
    megatron = 12 * batch * seq * L * h**2 * (1 + groups + 1.5 * f / h + seq / h + V / (2 * L * h))
    assert batch * seq * training_flops_per_token(cfg, seq, "full") == pytest.approx(megatron, rel=1e-12)


def test_recompute_extra_forward():
    cfg = load_config(None, ["--model.name=tiny-moe"]).model
    blocks = model_flops(cfg, SEQ, head=False)
    assert recompute_flops_per_token(cfg, SEQ, "none") == 0
    assert recompute_flops_per_token(cfg, SEQ, "full") == blocks.total
    assert recompute_flops_per_token(cfg, SEQ, "selective") == blocks.attention_core
    assert recompute_flops_per_token(cfg, SEQ, "selective", layers=[1]) == blocks.attention_core / 2
    selective = executed_flops_per_token(cfg, SEQ, "selective")
    assert selective == training_flops_per_token(cfg, SEQ) + blocks.attention_core


def test_stage_split_adds_up_to_the_model():
    cfg = load_config(None, ["--model.name=tiny-moe", "--model.n_layers=5", "--model.moe_every=2"]).model
    first = model_flops(cfg, SEQ, layers=range(0, 2), head=False)
    last = model_flops(cfg, SEQ, layers=range(2, 5), head=True)
    assert (first + last).total == pytest.approx(model_flops(cfg, SEQ).total)
    assert layer_flops(cfg, 0, SEQ).router == 0 and layer_flops(cfg, 1, SEQ).router > 0


def test_moe_flops_scale_with_top_k_not_experts():
    base = dict(dim=512, n_layers=4, n_heads=8, ffn_dim=2048, vocab_size=1000, moe_ffn_dim=256)
    few = ModelConfig(**base, n_experts=8, top_k=2)
    many = ModelConfig(**base, n_experts=64, top_k=2)
    wider = ModelConfig(**base, n_experts=64, top_k=4)
    assert model_flops(few, SEQ).ffn == model_flops(many, SEQ).ffn
    assert model_flops(many, SEQ).router - model_flops(few, SEQ).router == 4 * 2 * 512 * (64 - 8)
    assert model_flops(wider, SEQ).ffn == 2 * model_flops(many, SEQ).ffn
    shared = ModelConfig(**base, n_experts=64, top_k=2, n_shared_experts=2, shared_expert_gate=True)
    layer = layer_flops(shared, 0, SEQ)
    assert layer.ffn == 2 * 3 * 512 * (2 * 256 + 2 * 256)
    assert layer.router == 2 * 512 * (64 + 1)
    # The h×1 shared-expert gate: 6·h per token and MoE layer.
    without_gate = dataclasses.replace(shared, shared_expert_gate=False)
    assert training_flops_per_token(shared, SEQ) - training_flops_per_token(without_gate, SEQ) == 6 * 512 * 4


def test_sliding_window_counts_the_band_under_the_diagonal():
    s = 1024
    assert keys_per_query(s) == s / 2
    assert keys_per_query(s, attention="full") == s
    assert keys_per_query(s, window=s) == keys_per_query(s, window=4 * s) == s / 2
    for w in (1, 16, 256, 1000):
        exact = sum(min(i + 1, w) for i in range(s)) / s  # query i sees keys max(0, i-w+1)..i
        assert 0 <= exact - keys_per_query(s, w) <= 0.5
        assert keys_per_query(s, w, "full") == 2 * keys_per_query(s, w)
    cfg = load_config(None, ["--model.name=tiny", "--model.sliding_window=32"]).model
    q = cfg.n_heads * cfg.head_size
    assert layer_flops(cfg, 0, SEQ).attention_core == 4 * q * (32 - 32**2 / (2 * SEQ))
    unwindowed = dataclasses.replace(cfg, sliding_window=0)
    assert training_flops_per_token(cfg, SEQ) < training_flops_per_token(unwindowed, SEQ)
    assert training_flops_per_token(cfg, 32) == training_flops_per_token(unwindowed, 32)  # w = s: no band


def test_hardware_table_as_documented():
    assert set(ACCELERATORS) >= {"a100-40gb", "a100-80gb", "h100", "h800", "h200", "b200"}
    h100, h800, b200, a100 = (accelerator(n) for n in ("h100", "h800", "b200", "a100-40gb"))
    assert h100.bf16_flops_per_s == 989e12 and h100.fp8_flops_per_s == 1979e12
    assert h100.intra_node_bytes_per_s == 450e9  # 900 GB/s both directions
    assert h100.inter_node_bytes_per_s == 50e9  # 400 Gb/s NDR
    assert h100.memory_bytes == 80 * GiB and h100.hbm_bytes_per_s == 3.35e12
    assert h800.intra_node_bytes_per_s == 200e9 and h800.bf16_flops_per_s == h100.bf16_flops_per_s
    assert accelerator("h200").memory_bytes == 141 * GiB
    assert b200.bf16_flops_per_s == 2.25e15 and b200.fp8_flops_per_s == 4.5e15
    assert b200.intra_node_bytes_per_s == 900e9 and b200.hbm_bytes_per_s == 8e12
    assert a100.fp8_flops_per_s is None and a100.inter_node_bytes_per_s == 25e9
    assert accelerator("a100-80gb").hbm_bytes_per_s == 2.039e12
    assert all(acc.gpus_per_node == 8 and acc.sources for acc in ACCELERATORS.values())
    assert accelerator(" H100 ") is h100
    with pytest.raises(ConfigError, match="fp8"):
        peak_flops_per_s(a100, "fp8")
    assert peak_flops_per_s(h100, "fp8") == 1979e12


def test_unknown_gpu_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError) as err:
        accelerator("v100")
    assert all(name in str(err.value) for name in ACCELERATORS)
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        accelerator("h1000")


def test_link_overrides():
    h100 = accelerator("h100")
    slow = with_links(h100, intra_node_gbps=1600, inter_node_gbps=100, gpus_per_node=4)
    assert slow.intra_node_bytes_per_s == 200e9 and slow.inter_node_bytes_per_s == 12.5e9
    assert slow.gpus_per_node == 4
    assert (
        dataclasses.replace(slow, intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, gpus_per_node=8)
        == h100
    )
    assert with_links(h100) == h100 and h100.gpus_per_node == 8  # the table is untouched
    with pytest.raises(ConfigError) as err:
        with_links(h100, intra_node_gbps=0, inter_node_gbps=-1, gpus_per_node=0)
    assert len(err.value.problems) == 3
