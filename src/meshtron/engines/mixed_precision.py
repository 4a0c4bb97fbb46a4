"""Mixed precision where parameters stay whole on every rank (DDP, ZeRO-1/2): each weight held once in
the compute dtype, fp32 masters in the optimizer, fp32 gradient accumulation.

Autocast over fp32 weights casts each weight to bf16 at every use, and the matmul saves that copy for
backward: a pipeline stage with k micro-batches in flight holds k bf16 copies of its weights on top of
the fp32 ones. Here, as in Megatron-Core's distributed optimizer and FSDP2's MixedPrecisionPolicy, the
module's parameters are the bf16 copy itself, so every micro-batch reads (and saves for backward) the
same tensor, and autocast has nothing to cast:

  module parameter   the compute dtype (bf16), one copy per rank, shared by every micro-batch in flight
  master weight      fp32, the optimizer's: whole under DDP, the owned rows under ZeRO-1/2 (ZeRO-3's
                     engines shard them and gather each unit in the compute dtype: fsdp.py, simple_fsdp.py)
  gradient           autograd gives each micro-batch's in bf16 (what the matmul's backward computes under
                     autocast too); a hook adds it into an fp32 buffer at once and drops it, so the
                     accumulation over micro-batches and the reduction run in fp32 (or reduce_dtype)
  after the step     the masters' new values copied (DDP) or gathered (ZeRO-1/2) into the bf16 parameters

Per parameter that is 2 bytes (bf16) + 4 (fp32 gradient) + 12 (master, Adam's m and v) before sharding:
the 16Ψ + 2Ψ of Rajbhandari et al. (2020) with fp32 gradients. With fp32 training nothing of this runs:
the parameters are the masters.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def to_compute_dtype_(params: list[nn.Parameter], dtype: torch.dtype) -> list[torch.Tensor]:
    """Cast `params` in place to `dtype`; returns their values before the cast (fp32), for the masters."""
    before = [p.detach().clone() for p in params]
    for p in params:
        p.data = p.data.to(dtype)
    return before


def accumulate_in_fp32(param: nn.Parameter, buffer: torch.Tensor) -> None:
    """From now on each gradient autograd accumulates into `param` is added into `buffer` (fp32, its
    shape) and dropped. Registered before any other post-accumulate hook of `param` (the engine's
    readiness count), so that those see it already added."""

    def add(p: torch.Tensor) -> None:
        buffer.add_(p.grad)
        p.grad = None

    param.register_post_accumulate_grad_hook(add)
