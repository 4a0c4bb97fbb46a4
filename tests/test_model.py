"""Single-device model pieces: MoE routing and grouped experts against plain per-expert math, losses,
layout-independent initialisation, and the FLOP count against the real parameter count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshtron.config.schema import ModelConfig
from meshtron.models.init import init_region
from meshtron.models.layers import SwiGLU
from meshtron.models.llama import build_model
from meshtron.models.moe import MoE, capacity_keep, router_losses
from meshtron.models.rope import rope_inv_freq
from meshtron.rules.checks import load_config


def moe_config(**overrides) -> ModelConfig:
    base = dict(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=61, n_experts=5, top_k=2,
                moe_ffn_dim=20)  # fmt: skip
    base.update(overrides)
    return ModelConfig(**base)


def random_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def reference_moe(moe: MoE, x_TD: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Token-by-token loop: the definition the batched implementation must reproduce."""
    logits = x_TD.float() @ moe.router.weight.float().T
    scores = logits.softmax(-1) if moe.score_fn == "softmax" else logits.sigmoid()
    weights, experts = scores.topk(moe.top_k, -1)
    if moe.router.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    queues: dict[int, list[tuple[float, int, int]]] = {}
    for t in range(x_TD.shape[0]):
        for j in range(moe.top_k):
            queues.setdefault(int(experts[t, j]), []).append(
                (-float(scores[t, experts[t, j]].detach()), t, j)
            )
    kept = set()
    for queue in queues.values():  # each expert keeps its highest-scored assignments (earlier token on ties)
        kept |= {(t, j) for _, t, j in sorted(queue)[: capacity if capacity is not None else len(queue)]}
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for j in range(moe.top_k):
            e = int(experts[t, j])
            if (t, j) not in kept:
                continue
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            h = F.silu(x_TD[t] @ w1.T) * (x_TD[t] @ w3.T)
            out[t] += weights[t, j].to(out.dtype) * (h @ w2.T)
    if moe.shared_experts is not None:
        shared = moe.shared_experts(x_TD)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(moe.shared_gate(x_TD)) * shared
        out = out + shared
    return out


@pytest.mark.parametrize(
    "overrides, capacity_factor",
    [
        ({}, 0.0),
        ({"router": "sigmoid"}, 0.0),
        ({"router_norm_topk": False}, 0.0),
        ({"n_shared_experts": 1, "shared_expert_gate": True}, 0.0),
        ({"n_shared_experts": 2}, 0.0),
        ({"top_k": 1}, 0.0),
        ({}, 0.5),  # tight capacity: many assignments dropped
        ({}, 1.25),
    ],
)
def test_moe_matches_per_token_loop(overrides, capacity_factor):
    cfg = moe_config(capacity_factor=capacity_factor, **overrides)
    moe = random_moe(cfg)
    x = torch.randn(2, 7, cfg.dim, dtype=torch.float64)
    out, _ = moe(x)
    ref = reference_moe(moe, x.view(-1, cfg.dim), moe.capacity(14))
    assert (out.view(-1, cfg.dim) - ref).abs().max() < 1e-10


def test_capacity_drops_the_lowest_scored_assignments():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]])
    scores = torch.zeros(4, 4)
    scores[:, 0] = torch.tensor([0.1, 0.9, 0.5, 0.5])  # expert 0: token 1 best, tokens 2 and 3 tie
    keep = capacity_keep(scores, experts, capacity=2)
    assert keep[:, 0].tolist() == [False, True, True, False]  # the tie goes to the earlier token
    assert keep[:, 1].all()  # experts 1, 2, 3 are within capacity
    assert capacity_keep(scores, experts, capacity=None).all()


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_moe_gradients_match_per_token_loop(capacity_factor):
    cfg = moe_config(n_shared_experts=1, shared_expert_gate=True, capacity_factor=capacity_factor)
    moe = random_moe(cfg)
    x = torch.randn(3, 5, cfg.dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, cfg.dim, dtype=torch.float64)
    out, _ = moe(x)
    (out * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    x_grad = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    ref = reference_moe(moe, x.view(-1, cfg.dim), moe.capacity(15))
    (ref * upstream.view(-1, cfg.dim)).sum().backward()
    assert (x.grad - x_grad).abs().max() < 1e-10
    for name, p in moe.named_parameters():
        assert (p.grad - grads[name]).abs().max() < 1e-6, name  # the router runs in fp32
    assert grads["router.weight"].abs().sum() > 0 and grads["shared_gate.weight"].abs().sum() > 0


def test_router_loss_values():
    # Perfectly balanced routing with uniform probabilities: E * sum_e (k/E) * (1/E) = k.
    n_tokens, n_experts, k = 8, 4, 2
    scores = torch.full((n_tokens, n_experts), 1 / n_experts)
    logits = torch.zeros(n_tokens, n_experts)
    experts = torch.tensor([[t % 4, (t + 1) % 4] for t in range(n_tokens)])
    assert router_losses(scores, experts, logits, "softmax")[0].item() == pytest.approx(k)
    # Everything on expert 0 with all probability there: E * (k... only e0 counted) = E * 1 * 1 (top-1).
    scores = torch.zeros(n_tokens, n_experts)
    scores[:, 0] = 1
    top1 = torch.zeros(n_tokens, 1, dtype=torch.long)
    assert router_losses(scores, top1, logits, "softmax")[0].item() == 4.0
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = ((math.log(2.0)) ** 2 + (math.log(4.0)) ** 2) / 2
    assert router_losses(logits.softmax(-1), top1[:2], logits, "softmax")[1].item() == pytest.approx(expected)


def test_router_losses_of_split_tokens_summed_equal_the_whole():
    """Context parallel's seam: each part's statistics summed (here by hand) give the whole's losses."""
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    scores, experts = logits.softmax(-1), logits.topk(2, dim=-1).indices
    whole = router_losses(scores, experts, logits, "softmax")
    parts = [slice(0, 5), slice(5, 12)]
    stats = []

    def grab(part_stats):
        stats.append(part_stats)
        return part_stats

    for p in parts:
        router_losses(scores[p], experts[p], logits[p], "softmax", grab)
    total = stats[0] + stats[1]
    split = router_losses(scores[parts[0]], experts[parts[0]], logits[parts[0]], "softmax", lambda _: total)
    assert torch.allclose(torch.stack(split), torch.stack(whole), rtol=1e-6)


def test_aux_loss_reaches_model_output():
    cfg = load_config(None, ["--model.name=tiny-moe", "--model.z_loss_coef=0.001"]).model
    model = build_model(cfg, seed=0)
    _, aux = model(torch.randint(0, cfg.vocab_size, (2, 8)), return_aux=True)
    assert aux.item() > 0
    dense = build_model(load_config(None, ["--model.name=tiny"]).model, seed=0)
    assert dense(torch.zeros(1, 4, dtype=torch.long), return_aux=True)[1].item() == 0


def test_initialisation_is_per_parameter_and_layout_independent():
    cfg = load_config(None, ["--model.name=tiny"]).model
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # A parameter's value depends only on (seed, name, shape): a deeper model shares its first layers.
    deeper = build_model(load_config(None, ["--model.name=tiny", "--model.n_layers=3"]).model, seed=3)
    wq = "layers.1.attention.wq.weight"
    assert torch.equal(dict(a.named_parameters())[wq], dict(deeper.named_parameters())[wq])
    assert not torch.equal(
        dict(build_model(cfg, seed=4).named_parameters())[wq], dict(a.named_parameters())[wq]
    )
    # Different names draw different values, norms start at one, biases at zero.
    params = dict(a.named_parameters())
    assert not torch.equal(params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"])
    assert torch.equal(params["norm.weight"], torch.ones(cfg.dim))
    assert torch.equal(init_region("x.wq.bias", (4,), [(0, 4)], cfg, 0), torch.zeros(4))
    assert params["layers.0.feed_forward.w1.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.1)


def test_llama3_rope_scaling_keeps_high_frequencies():
    cfg = ModelConfig(dim=128, n_heads=1, rope_theta=500000.0)
    plain = rope_inv_freq(cfg)
    scaled = rope_inv_freq(ModelConfig(dim=128, n_heads=1, rope_theta=500000.0, rope_scaling="llama3"))
    assert torch.equal(scaled[:4], plain[:4])  # short wavelengths untouched
    assert torch.allclose(scaled[-4:], plain[-4:] / 8.0)  # long wavelengths divided by the factor


def test_positions_are_explicit():
    cfg = load_config(None, ["--model.name=tiny"]).model
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    default = model(tokens)
    explicit = model(tokens, torch.arange(6)[None])
    shifted = model(tokens, torch.arange(6)[None] + 5)
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, shifted)


def test_the_fused_swiglu_is_autograds_silu_times_up_and_keeps_gate_and_up():
    """The dense FFN's SwiGLU (models/layers.py): value and gradients are autograd's of silu(gate)·up; it
    saves gate and up only (silu(gate) is made again in backward), so the FFN keeps three FFN-wide tensors
    with the down-projection's input; under bf16 inputs it computes in fp32 and returns bf16."""
    gate, up = (torch.randn(5, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    probe = torch.randn(5, 6, dtype=torch.float64)
    ours = torch.autograd.grad((SwiGLU.apply(gate, up) * probe).sum(), (gate, up))
    plain = torch.autograd.grad((F.silu(gate) * up * probe).sum(), (gate, up))
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SwiGLU.apply(gate, up)
    assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr()]
    assert SwiGLU.apply(gate.bfloat16(), up.bfloat16()).dtype == torch.bfloat16
