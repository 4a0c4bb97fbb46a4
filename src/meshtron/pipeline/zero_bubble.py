"""Zero-bubble's split backward: B computes input gradients now, W the linear layers' weight gradients later.

Inside a `DeferWeightGrads` mode every `F.linear` whose weight wants a gradient runs as `_Linear`, whose
backward returns the input (and bias) gradient and, instead of the weight's, records the layer's input
and output gradient. B is then one ordinary backward through the chunk, which also gives every other
parameter (norms, embeddings, experts) its gradient and frees the graph; W turns each record into
dW = dYᵀ·X. W hands those to autograd through `_Accumulate`, so parameter gradient hooks
(tensor-parallel sums, data-parallel reductions) run for them as for any other gradient.

What lives between B and W is each linear layer's input and output gradient, as in Qi et al. (2023).
The mode stays on during B too, so that activation recompute reruns the same `_Linear` forward; a
checkpoint taken inside it replays `active_deferrals()` (tracked here, not read from torch's private
mode stack).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, records: list
    ) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # compute as autocast would, in its dtype
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.records = bias is not None, records
        with torch.autocast(device, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        ctx.records.append((x.detach(), grad_y.detach()))
        grad_bias = grad_y.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_y @ weight, None, grad_bias, None


class _Accumulate(torch.autograd.Function):
    """A zero whose backward gives `weight` the gradient `grad`: accumulation with the usual hooks."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return grad.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        return ctx.grad, None


class _Active(threading.local):
    """Per thread (as torch's mode stack is): entered and not yet left, innermost last. A DualPipeV pair
    runs one micro-batch's forward in a second thread while this one back-propagates another."""

    def __init__(self) -> None:
        self.modes: list[DeferWeightGrads] = []


_ACTIVE = _Active()


def active_deferrals() -> list[DeferWeightGrads]:
    """The DeferWeightGrads modes on now in this thread, outermost first (for activation recompute to
    replay: a checkpoint captures them in the forward that it will rerun)."""
    return list(_ACTIVE.modes)


class DeferWeightGrads(TorchFunctionMode):
    """One per (chunk, micro-batch): on around its forward and its B; `weight_grads()` is its W."""

    def __enter__(self) -> DeferWeightGrads:
        _ACTIVE.modes.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.modes.pop()
        super().__exit__(*exc)

    def __init__(self) -> None:
        super().__init__()
        # Per linear call: its weight and the (input, output gradient) its backward recorded.
        self.calls: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            weight = named["weight"]
            if weight.requires_grad:
                records: list[tuple[torch.Tensor, torch.Tensor]] = []
                self.calls.append((weight, records))
                # Detached: were the weight an input of the graph, B would reach its AccumulateGrad,
                # whose post-accumulate hooks (data-parallel readiness counts) fire even for no gradient.
                return _Linear.apply(named["input"], weight.detach(), named.get("bias"), records)
        return func(*args, **kwargs)

    def weight_grads(self) -> None:
        """W: accumulate every deferred weight gradient (after B)."""
        with torch.no_grad():
            grads = [
                (weight, (grad_y.flatten(0, -2).t() @ x.flatten(0, -2)).to(weight.dtype))
                for weight, records in self.calls
                for x, grad_y in records
            ]
        zeros = [_Accumulate.apply(weight, grad) for weight, grad in grads]
        self.calls.clear()
        if zeros:
            torch.autograd.backward(torch.stack(zeros).sum())
