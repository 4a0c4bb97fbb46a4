"""Zero-bubble's split backward: B gives the input and the non-linear parameters their gradients, W the
linear weights theirs, together exactly what one ordinary backward gives; every parameter's gradient
hook fires once, in the phase that produced its gradient. What waits between B and W is exactly the
planner's count, for grouped-query and latent attention, dense and MoE layers, under tp and sp."""

from __future__ import annotations

import pytest
import torch

from meshtron.comm.collectives import Comm
from meshtron.commands.dry_run import resolved
from meshtron.config.layout import ParallelDims
from meshtron.models.llama import build_model
from meshtron.models.mtp import depth_inputs
from meshtron.models.rope import rope_cos_sin
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.pipeline.zero_bubble import DeferWeightGrads
from meshtron.plan.gpu_memory import waiting_weight_grad_bytes
from meshtron.rules.checks import load_config
from meshtron.testing.parity import mesh_for


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


BATCH, SEQ = 2, 16


def waiting_bytes(keys: list[str], tp: int, sp: bool) -> int:
    """The distinct storages that the blocks' deferred linear layers hold after B (their inputs and
    output gradients) for one micro-batch, on this tp rank (fp32)."""
    cfg = load_config(None, keys).model
    model, rank = build_model(cfg, seed=0), 0
    if tp > 1:
        group = mesh_for(ParallelDims(tp=tp)).group("tp")
        apply_tensor_parallel(model, Comm(), group, sp)
        rank = group.rank
    gen = torch.Generator().manual_seed(0)
    x, grad_out = (torch.randn(BATCH, SEQ, cfg.dim, generator=gen) for _ in range(2))
    if sp:  # this rank's share of the sequence
        x, grad_out = (t.chunk(tp, dim=1)[rank] for t in (x, grad_out))
    mode = DeferWeightGrads()
    with mode:
        h = x.clone().requires_grad_(True)
        cos, sin = rope_cos_sin(model.rope_inv_freq, torch.arange(SEQ).expand(BATCH, -1), h.dtype)
        for block in model.layers.values():
            h, _ = block(h, cos, sin)
        h.backward(grad_out)
    return held_for_w(mode)


def held_for_w(mode: DeferWeightGrads) -> int:
    """Bytes of the distinct storages that `mode`'s records hold (inputs, output gradients) until W."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for _, records in mode.calls for pair in records for t in pair}  # fmt: skip
    return sum(storages.values())


SHARED_GATE = ["--model.name=tiny-moe", "--model.shared_expert_gate=true"]
WAITING = {
    "gqa": (["--model.name=tiny"], 1, False),
    "moe_shared_gated": (SHARED_GATE, 1, False),
    "mla": (["--model.name=tiny-deepseek"], 1, False),
    "mla_full_q": (["--model.name=tiny-deepseek", "--model.q_lora_rank=0"], 1, False),
    "gqa_tp2_sp": (["--model.name=tiny"], 2, True),
    "moe_tp2_sp": (SHARED_GATE, 2, True),
    "mla_tp2": (["--model.name=tiny-deepseek"], 2, False),
    "mla_tp2_sp": (["--model.name=tiny-deepseek"], 2, True),  # the latents enter the tp region
    "mla_full_q_tp2_sp": (["--model.name=tiny-deepseek", "--model.q_lora_rank=0"], 2, True),
}


@pytest.mark.parametrize("case", list(WAITING))
def test_what_waits_for_w_is_the_planners_count(workers, case):
    """Shared experts and latent attention's projections used to be left out of the count (an MoE
    block with a shared expert waited 1.9x the count, MLA under tp 1.2x)."""
    keys, tp, sp = WAITING[case]
    measured = workers(tp).run(waiting_bytes, keys, tp, sp) if tp > 1 else [waiting_bytes(keys, 1, False)]
    layout = [f"--parallel.tp={tp}", f"--parallel.sp={str(sp).lower()}", "--training.dtype=fp32"]
    batch = [
        f"--training.micro_batch={BATCH}",
        f"--training.seq_len={SEQ}",
        f"--training.global_batch={BATCH}",
    ]
    cfg = resolved(load_config(None, [*keys, *layout, *batch]), tp)
    want = waiting_weight_grad_bytes(cfg, list(range(cfg.model.n_layers)), last=False)
    assert measured == [want] * tp


@pytest.mark.parametrize("mtp_depth", [0, 2])
def test_the_last_chunk_waits_for_the_head_and_each_mtp_depth(mtp_depth):
    """The whole model as the last chunk: the blocks, the head, and each multi-token prediction depth's
    projection, block and its call of the head."""
    keys = ["--model.name=tiny-deepseek", f"--model.mtp_depth={mtp_depth}", "--training.dtype=fp32"]
    batch = [
        f"--training.micro_batch={BATCH}",
        f"--training.seq_len={SEQ}",
        f"--training.global_batch={BATCH}",
    ]
    cfg = resolved(load_config(None, [*keys, *batch]), 1)
    model = build_model(cfg.model, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=gen)
    mode = DeferWeightGrads()
    with mode:
        ahead = depth_inputs(tokens, tokens, mtp_depth)[0] if mtp_depth else None
        logits = model(tokens, mtp_tokens=ahead)
        logits = logits if isinstance(logits, tuple) else (logits,)
        sum((out * torch.randn(out.shape, generator=gen)).sum() for out in logits).backward()
    assert held_for_w(mode) == waiting_weight_grad_bytes(cfg, list(range(cfg.model.n_layers)), last=True)
