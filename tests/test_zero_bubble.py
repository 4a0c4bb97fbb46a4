"""Zero-bubble's split backward on one process: B gives the input and the non-linear parameters their
gradients, W the linear weights theirs, together exactly what one ordinary backward gives; every
parameter's gradient hook fires once, in the phase that produced its gradient."""

from __future__ import annotations

import pytest
import torch

from meshtron.models.llama import build_model
from meshtron.models.rope import rope_cos_sin
from meshtron.parallel.recompute import apply_recompute
from meshtron.pipeline.zero_bubble import DeferWeightGrads
from meshtron.rules.checks import load_config


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_split_backward_equals_ordinary_backward(recompute):
    cfg = load_config(None, ["--model.name=tiny", "--model.n_layers=2", "--model.qkv_bias=true"]).model
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, -1)

    def run(deferred: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, list[str]]]:
        model = build_model(cfg, seed=0)
        apply_recompute(model, recompute)
        fired: dict[str, list[str]] = {}
        phase = ["B"]
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.setdefault(n, []).append(phase[0]))
        inputs = x.clone().requires_grad_(True)
        mode = DeferWeightGrads() if deferred else None
        with mode or torch.enable_grad():
            h = inputs
            cos, sin = rope_cos_sin(model.rope_inv_freq, positions, h.dtype)
            for block in model.layers.values():
                h, _ = block(h, cos, sin)
        with mode or torch.enable_grad():
            h.backward(grad_out)
        if mode is not None:
            phase[0] = "W"
            mode.weight_grads()
        grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("layers.")}
        return grads, inputs.grad, fired

    want, want_input, _ = run(deferred=False)
    got, got_input, fired = run(deferred=True)
    torch.testing.assert_close(got_input, want_input, rtol=1e-6, atol=1e-7)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        linear_weight = name.endswith(".weight") and "norm" not in name
        assert fired[name] == (["W"] if linear_weight else ["B"]), (name, fired[name])
