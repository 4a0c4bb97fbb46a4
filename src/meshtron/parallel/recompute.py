"""Activation recompute: keep less for backward, recompute it there.

  full       each transformer block keeps only its input; its whole forward is rerun in backward
  selective  only the attention core (rotary embedding + attention) is rerun; everything else is kept
  op         each block keeps its input and the outputs of chosen operations, per operation: every
             matmul's (or every other one's, or every one's but MLA's up-projections, DeepSeek-V3's
             recipe: `training.op_recompute_saves`) but the routed experts' down-projection (whose
             output no backward needs: the rerun stops before it) and the attention kernels' (with
             their log-sum-exp); backward reruns the block's forward, where a kept output is taken
             from the store instead of computed (torch's selective checkpoint API), so only the cheap
             operations are done twice: norms, rotary, SwiGLU's product, softmax, casts. The expert
             dispatch's outputs are kept too (comm/kept_outputs.py: the rerun does not send the routed
             rows again), unless `training.op_recompute_dispatch = "rerun"` trades that memory for a
             second dispatch. Sequence parallel's reduce-scatter after the attention is kept too: the
             rerun gathers each region's input again, as backward would anyway, and reduces nothing
             again (without sp the attention's all-reduce runs again). torchtitan's op-level policy
             keeps its reduce-scatters' outputs likewise (the collectives it issues inside a block)

The wrapped callables are the block's `forward` and the attention's `core`, replaced on the instance so
that parameter names and module hooks (FSDP, tensor parallel) stay where they are: a block's own hooks
run once, around the checkpointed forward, not again during recomputation. `torch.utils.checkpoint`
restores the RNG state for the rerun, so the recomputed activations are the ones of the forward.
"""

from __future__ import annotations

import contextlib
import threading
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshtron.comm.autograd import out_of_place
from meshtron.comm.kept_outputs import KeptOutputs, keeping, replaying
from meshtron.config.schema import OpRecomputeSaves, Recompute
from meshtron.models.latent_attention import LatentAttention
from meshtron.models.llama import Transformer
from meshtron.models.moe import loads_not_counted
from meshtron.models.rerun import rerunning
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
        stack.enter_context(rerunning())
        yield


def _checkpointed(
    fn: Callable[..., Any],
    context_fn: Callable[[], tuple[Any, Any]] = _replay_function_modes,
) -> Callable[..., Any]:
    # Never traced by torch.compile (its checkpoint cannot take this context_fn): compiled blocks call
    # it eagerly, around the compiled forward (full) or as a break in the block's graph (selective).
    @torch.compiler.disable
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


_aten = torch.ops.aten
MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default} | {
    op.default
    for op in (getattr(_aten, name, None) for name in ("_grouped_mm", "_scaled_mm"))
    if op is not None
}
# The attention kernels SDPA dispatches to (CPU's fused kernel, CUDA's flash, memory-efficient, cuDNN).
ATTENTION = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
}


class _Region(threading.local):
    """Whether this thread is inside an attention core (its operations follow the attention rule of the
    op policy, not the matmul one), or inside a matmul whose output the op policy does not keep: the
    routed experts' down-projection (no backward needs its output, and the rerun stops before it:
    models/moe.py `take_rows`), MLA's up-projections under "matmuls_but_mla_up". Set by `_inside`."""

    attention = False
    not_kept = False


_REGION = _Region()


def _inside(region: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        before = getattr(_REGION, region)
        setattr(_REGION, region, True)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(_REGION, region, before)

    return run


def op_policy(
    saves: OpRecomputeSaves, keep_attention: bool, keep_dispatch: bool = True
) -> Callable[[], tuple[Any, Any]]:
    """The context_fn of one block's checkpoint under recompute = "op": a fresh policy per call (it
    counts the block's matmuls, in forward and in the rerun alike), with the replay modes on the rerun.
    Inside the attention core only an attention kernel's outputs are kept, and only with
    `keep_attention` (without context parallel: there the core is one kernel; under cp it is a ring of
    partial blocks, or a tiled path whose matmuls are score tiles, so the core is recomputed whole).
    `keep_dispatch`: the expert dispatch's outputs too (else the rerun sends them again)."""

    def context_fn() -> tuple[Any, Any]:
        counts = {False: 0, True: 0}  # matmuls seen, by is_recompute

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if _REGION.attention:
                keep = keep_attention and op in ATTENTION
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            if op in MATMULS and _REGION.not_kept:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if op in MATMULS:
                index, counts[ctx.is_recompute] = counts[ctx.is_recompute], counts[ctx.is_recompute] + 1
                if saves != "every_other_matmul" or index % 2 == 0:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        forward, rerun = create_selective_checkpoint_contexts(policy)
        # The collectives' outputs the rerun reads (comm/kept_outputs.py): sp's reduce-scatter after the
        # attention, and the expert dispatch's unless told to send it again.
        collectives = KeptOutputs(frozenset({"tp", "dispatch"} if keep_dispatch else {"tp"}))
        # A kept matmul output must not be reduced in place afterwards (tensor parallel's partial sums).
        return _both(forward, _both(out_of_place(), keeping(collectives))), _both(
            rerun, _both(_both(out_of_place(), replaying(collectives)), _entered(active_deferrals()))
        )

    return context_fn


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager
) -> Iterator[None]:
    with first, second:
        yield


def apply_recompute(
    model: Transformer,
    mode: Recompute,
    op_saves: OpRecomputeSaves = "matmuls",
    keep_attention: bool = True,
    keep_dispatch: bool = True,
) -> None:
    """The recompute step of `parallelize`: wrap what `mode` reruns in backward (nothing for "none").
    Mode "op": `keep_attention`, keep the attention kernel's outputs (False under context parallel);
    `keep_dispatch`, keep what the expert dispatch delivered rather than send it again in the rerun."""
    if mode not in typing.get_args(Recompute):
        raise ValueError(f"training.recompute={mode!r} is not one of {', '.join(typing.get_args(Recompute))}")
    for _, block in model.blocks():
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            block.attention.core = _checkpointed(block.attention.core)
        elif mode == "op":
            block.attention.core = _inside("attention", block.attention.core)
            if op_saves == "matmuls_but_mla_up" and isinstance(block.attention, LatentAttention):
                _mark_up_projections(block.attention)
            if block.moe is not None:
                block.moe.experts.down = _inside("not_kept", block.moe.experts.down)
            block.forward = _checkpointed(block.forward, op_policy(op_saves, keep_attention, keep_dispatch))


def _mark_up_projections(attention: LatentAttention) -> None:
    """MLA's up-projections (the queries' from their latent, the keys' and values' from theirs) run
    inside the up-projection region, so the op policy recomputes their outputs from the latents."""
    attention.up = _inside("not_kept", attention.up)
    if attention.wq_b is not None:
        attention.wq_b.forward = _inside("not_kept", attention.wq_b.forward)
