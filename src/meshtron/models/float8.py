"""Float8 linear layers with dynamic scaling: the arithmetic of `training.dtype = "fp8"`.

A float8 linear layer runs its three matmuls on float8 operands, each cast with a scale computed from
the tensor at that moment (dynamic scaling: no amax history), and accumulates in fp32:

  forward   y  = x·Wᵀ     x and W in e4m3 (3 mantissa bits, max 448): activations and weights
  backward  dx = dy·W     dy in e5m2 (2 mantissa bits, max 57344: gradients need the range), W in e4m3
            dW = dyᵀ·x    dy in e5m2, x in e4m3

A cast maps a group of values onto the format's range: scale = amax / max_representable, q = x / scale
rounded to the format, and the matmul multiplies its result by the two operands' scales. The group is
the recipe's (Micikevicius et al. 2022, "FP8 formats for deep learning"; torchao's recipes):

  tensorwise  one scale per operand
  rowwise     one scale per row of the left operand and per column of the right one, both taken along
              the contraction dimension (so each output element is scaled by one pair): finer, robust
              to a few outlier tokens or channels

Under tensor parallel a group can span ranks (a weight split by rows, a gradient split by columns):
its amax is then reduced (max) over the tp group before the cast, `reduce(tensor, axis)` below, so that
every rank casts with the scale one device would use.

The matmul is `torch._scaled_mm` on CUDA (float8 tensor cores; a private operator with no public
equivalent, on the architecture test's list) and, elsewhere, the same arithmetic emulated: the float8
values widened to fp32 (exactly), multiplied in fp32, scaled. Both accumulate in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# `reduce(amax, axis)`: the amax of one operand reduced over the ranks its scale group spans (None:
# tensorwise); identity on one device.
Reduce = Callable[[torch.Tensor, int | None], torch.Tensor]
Reducers = tuple[Reduce, Reduce, Reduce]  # the amax reductions of x, W and dy


def no_reduce(amax: torch.Tensor, axis: int | None) -> torch.Tensor:
    return amax


def quantize(
    t: torch.Tensor, dtype: torch.dtype, axis: int | None, reduce: Reduce
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale in `dtype`, scale in fp32): one scale for the whole tensor (axis None) or one per slice
    along `axis` (amax over that axis, kept as a size-1 dim)."""
    t32 = t.float()
    amax = t32.abs().amax() if axis is None else t32.abs().amax(dim=axis, keepdim=True)
    amax = reduce(amax, axis)
    scale = torch.clamp(amax, min=1e-12) / torch.finfo(dtype).max
    return (t32 / scale).to(dtype), scale


def scaled_mm(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(a·scale_a) @ (b·scale_b) for float8 a [M, K], b [K, N], accumulated in fp32, in `out_dtype`.
    scale_a is [] or [M, 1], scale_b [] or [1, N]."""
    if a.is_cuda:  # row-major a, column-major b, as the tensor cores take them
        b = b.t().contiguous().t()
        return torch._scaled_mm(a.contiguous(), b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


def float8_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, rowwise: bool, reducers: Reducers
) -> Tensor:
    """y = x Wᵀ (+ b) for x [..., in], its matmuls in float8 (`Float8Linear` on the 2-D view)."""
    y = Float8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, rowwise, reducers)
    return y.view(*x.shape[:-1], y.shape[-1])


class Float8Linear(torch.autograd.Function):
    """y = x Wᵀ (+ b) for x [tokens, in] with the three matmuls in float8 (the module docstring).
    `reducers` = (for x, for W, for dy): each operand's amax reduction over the ranks sharing its scale
    groups."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rowwise: bool,
        reducers: tuple[Reduce, Reduce, Reduce],
    ) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x_c = x.to(out_dtype)  # as autocast would cast it; kept for backward
        xq, sx = quantize(x_c, E4M3, 1 if rowwise else None, reducers[0])
        wq, sw = quantize(weight, E4M3, 1 if rowwise else None, reducers[1])
        y = scaled_mm(xq, sx, wq.t(), sw.t() if rowwise else sw, out_dtype)
        # Tensorwise, backward's casts of x and W are these; rowwise ones run along the other dimension.
        ctx.save_for_backward(*((x_c, weight) if rowwise else (xq, sx, wq, sw)))
        ctx.rowwise, ctx.reducers, ctx.out_dtype, ctx.x_dtype = rowwise, reducers, out_dtype, x.dtype
        ctx.weight_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return y + bias.to(out_dtype) if bias is not None else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        rx, rw, rdy = ctx.reducers
        if ctx.rowwise:
            x, weight = ctx.saved_tensors
            # dx = dy·W contracts the output features (dy's columns, W's rows), dW = dyᵀ·x the tokens
            dyq, sdy = quantize(dy, E5M2, 1, rdy)
            wq, sw = quantize(weight, E4M3, 0, rw)
            dytq, sdyt = quantize(dy, E5M2, 0, rdy)
            xq, sx = quantize(x, E4M3, 0, rx)
            dytq, sdyt = dytq.t(), sdyt.t()
        else:  # one scale per operand: one cast of dy serves both, x and W are the forward's
            xq, sx, wq, sw = ctx.saved_tensors
            dyq, sdy = quantize(dy, E5M2, None, rdy)
            dytq, sdyt = dyq.t(), sdy
        dx = scaled_mm(dyq, sdy, wq, sw, ctx.out_dtype)
        dw = scaled_mm(dytq, sdyt, xq, sx, torch.float32)
        db = dy.float().sum(0) if ctx.has_bias else None
        return dx.to(ctx.x_dtype), dw.to(ctx.weight_dtype), db, None, None
