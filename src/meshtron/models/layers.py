"""Building blocks shared by the dense and mixture-of-experts models, and the torch dtypes configs name."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = types.MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
)  # config.DType -> torch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do, then return to the compute dtype.
        x_f32 = x.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def swiglu_grads(
    gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For h = silu(gate)·up and dL/dh = `grad_h` (all in one wide dtype): (dL/dgate, dL/dup, silu(gate)),
    with silu'(g) = σ(g)·(1 + g·(1 − σ(g)))."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    return grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * silu, silu


class SwiGLU(torch.autograd.Function):
    """silu(gate)·up in one step, computed in fp32 (or wider) and returned in gate's dtype. Backward keeps
    gate and up and makes silu(gate) again, so the activation keeps two FFN-wide tensors where silu and
    the product as separate ops keep four (gate, silu(gate), up, the product); with the product the down
    projection keeps for its weight's gradient, the FFN keeps three, as Megatron-Core's fused SwiGLU."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        wide = torch.promote_types(gate.dtype, torch.float32)
        return (F.silu(gate.to(wide)) * up.to(wide)).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        gate, up = ctx.saved_tensors
        wide = torch.promote_types(gate.dtype, torch.float32)
        grad_gate, grad_up, _ = swiglu_grads(gate.to(wide), up.to(wide), grad.to(wide))
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(SwiGLU.apply(self.w1(x), self.w3(x)))
