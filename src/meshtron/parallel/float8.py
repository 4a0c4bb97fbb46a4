"""The float8 step of `parallelize` (`training.dtype = "fp8"`): the attention and MLP projections of every
block run as float8 linear layers (models/float8.py), the rest stays in bf16 under autocast.

  float8     wq, wk, wv, wo (MLA: wq or wq_a, wq_b, wkv_a, wkv_b, wo); the dense FFN's w1, w3, w2; the
             shared experts' w1, w3, w2
  bf16       the embedding and the output head (the logits' range and the loss's precision), the norms,
             the router (a rounding flips a token's expert), the attention core (softmax), the routed
             experts (their grouped matmul has no float8 form on the CPU, and on GPUs torch's grouped
             float8 matmul needs Hopper-only kernels: kept bf16 here), key/value projections whose heads
             tensor parallel replicates (fewer heads than tp ranks)

Under tensor parallel a linear layer's operands are split: column-parallel layers hold rows of W and
produce columns of y (so of dy), row-parallel ones hold columns of x and of W. A scale group that spans
the split is reduced over tp with max before the cast (tensorwise: every split operand; rowwise: those
whose scale is taken along the split dimension), so every rank casts exactly as one device would. MLA's
down-projections under sequence parallel are whole but see 1/tp of the tokens: their x and dy are split
along the tokens.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import Float8Recipe
from meshtron.models.float8 import Reduce, float8_linear, no_reduce
from meshtron.models.llama import Transformer
from meshtron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

FLOAT8_LINEARS = (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo",
    "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
    "moe.shared_experts.w1", "moe.shared_experts.w3", "moe.shared_experts.w2",
    "attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b",
)  # fmt: skip


def float8_weight_names(model: nn.Module) -> frozenset[str]:
    """The names of `model`'s parameters that float8 layers use as weights (ZeRO-3 may gather them so):
    the layers carry their recipe (`float8_recipe`), set by apply_float8."""
    return frozenset(
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if getattr(module, "float8_recipe", None) is not None
    )


def _reducer(comm: Comm, tp: CommGroup | None, split_dim: int | None) -> Reduce:
    """An operand's amax reduction: over tp (max) when its scale group spans `split_dim` (the dim of its
    2-D view that tp splits; None: not split)."""
    if split_dim is None or tp is None or tp.size == 1:
        return no_reduce

    def reduce(amax: torch.Tensor, axis: int | None) -> torch.Tensor:
        if axis is None or axis == split_dim:
            return comm.all_reduce_(amax.contiguous(), tp, op="max")
        return amax

    return reduce


def _reducers(linear: nn.Linear, comm: Comm, tp: CommGroup | None) -> tuple[Reduce, Reduce, Reduce]:
    """(for x [tokens, in], W [out, in], dy [tokens, out]) of this layer's kind."""
    if isinstance(linear, ColumnParallelLinear):  # rows of W, columns of y
        return no_reduce, _reducer(comm, tp, 0), _reducer(comm, tp, 1)
    if isinstance(linear, RowParallelLinear):  # columns of x and of W
        return _reducer(comm, tp, 1), _reducer(comm, tp, 1), no_reduce
    if getattr(linear, "tokens_split", False):  # rows of x and of y: MLA's down-projections under sp
        return _reducer(comm, tp, 0), no_reduce, _reducer(comm, tp, 0)
    return no_reduce, no_reduce, no_reduce


def _float8_forward(linear: nn.Linear, recipe: Float8Recipe, reducers: tuple[Reduce, Reduce, Reduce]):
    exit_fn = getattr(linear, "exit_fn", None)  # a row-parallel layer's reduction of its partial sums

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = float8_linear(x, self.weight, self.bias, recipe == "rowwise", reducers)
        return exit_fn(y) if exit_fn is not None else y

    return types.MethodType(forward, linear)


def apply_float8(model: Transformer, recipe: Float8Recipe, comm: Comm, tp: CommGroup | None) -> int:
    """Make FLOAT8_LINEARS of every block float8 linear layers (on the instances); returns how many.
    `tp`: the tensor-parallel group the layers are split over (None: one device)."""
    count = 0
    for _, block in model.blocks():
        for path in FLOAT8_LINEARS:
            try:
                linear = block.get_submodule(path)
            except AttributeError:  # a dense block's MoE parts, an MoE block's dense FFN
                continue
            if type(linear) not in (nn.Linear, ColumnParallelLinear, RowParallelLinear):
                continue  # a replicated key/value head projection (stays bf16)
            linear.forward = _float8_forward(linear, recipe, _reducers(linear, comm, tp))
            linear.float8_recipe = recipe
            count += 1
    return count
