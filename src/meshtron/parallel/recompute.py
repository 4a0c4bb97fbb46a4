"""Activation recompute: keep less for backward, recompute it there.

  full       each transformer block keeps only its input; its whole forward is rerun in backward
  selective  only the attention core (rotary embedding + attention) is rerun; everything else is kept

The wrapped callables are the block's `forward` and the attention's `core`, replaced on the instance so
that parameter names and module hooks (FSDP, tensor parallel) stay where they are: a block's own hooks
run once, around the checkpointed forward, not again during recomputation. `torch.utils.checkpoint`
restores the RNG state for the rerun, so the recomputed activations are the ones of the forward.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from meshtron.config import Recompute
from meshtron.models.llama import Transformer
from meshtron.models.moe import loads_not_counted
from meshtron.pipeline.zero_bubble import active_deferrals


def _replay_function_modes() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Recompute under the weight-gradient deferrals the forward ran under (a split-backward pipeline's),
    so that the rerun saves the same tensors the forward did; an MoE layer's expert loads were counted
    by the forward, so the rerun does not count them again."""
    return contextlib.nullcontext(), _entered(active_deferrals())


@contextlib.contextmanager
def _entered(modes: list[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        stack.enter_context(loads_not_counted())
        yield


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Never traced by torch.compile (its checkpoint cannot take this context_fn): compiled blocks call
    # it eagerly, around the compiled forward (full) or as a break in the block's graph (selective).
    @torch.compiler.disable
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_replay_function_modes, **kwargs)

    return run


def apply_recompute(model: Transformer, mode: Recompute) -> None:
    """The recompute step of `parallelize`: wrap what `mode` reruns in backward (nothing for "none")."""
    if mode not in typing.get_args(Recompute):
        raise ValueError(f"training.recompute={mode!r} is not one of {', '.join(typing.get_args(Recompute))}")
    for block in model.layers.values():
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            block.attention.core = _checkpointed(block.attention.core)
