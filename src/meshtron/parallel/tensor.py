"""Tensor parallel (Megatron-style) and sequence parallel over the tp group.

`apply_tensor_parallel` turns a built single-device model into this rank's shard of it, in place:
each weight is replaced by its slice of the same logical tensor (so initialisation and checkpoints are
layout-independent), and the layers' parameter names do not change.

  attention   wq, wk, wv column-parallel (this rank's H/tp query heads and K/tp key/value heads; when
              K < tp, every rank keeps all K key/value heads and uses the one its query heads read),
              wo row-parallel
  SwiGLU      w1, w3 column-parallel, w2 row-parallel
  MoE         router replicated, every expert's FFN split like SwiGLU (expert tensor parallel = tp); the
              routed and shared outputs are combined while still partial, then reduced once
  embedding   vocab-parallel: rows [r*V/tp, (r+1)*V/tp) of the (padded) vocabulary
  head        vocab-parallel logits, and `vocab_parallel_cross_entropy` never gathers them

A tensor-parallel region starts where a norm's output enters the column-parallel layers and ends at
the row-parallel layer's output:

              enter (after attention_norm / ffn_norm / final norm)     exit (after wo / w2 / MoE / embedding)
  tp          copy forward, all-reduce backward  (Megatron's f)         all-reduce forward, copy backward (g)
  tp + sp     all-gather the sequence forward,                          reduce-scatter the sequence forward,
              reduce-scatter backward                                   all-gather backward

With sp the residual stream, the norms and the embedding output hold 1/tp of the sequence. Weights that
every tp rank holds whole but that see only part of the work (norms under sp, q/k norms, the router,
the shared-expert gate, replicated key/value projections) get a gradient hook that sums their gradient
over the tp group. Each tp rank back-propagates the same (replicated) loss, as in Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.comm import Comm, CommGroup
from meshtron.models.layers import RMSNorm
from meshtron.models.llama import Attention, Transformer
from meshtron.models.moe import MoE


@dataclass
class TensorParallelPlan:
    """How each logical parameter was cut: the dim split over tp (None: whole on every rank) and its
    logical size along that dim (the vocabulary is padded to a multiple of tp)."""

    tp: CommGroup
    split_dims: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    vocab_start: int = 0
    vocab_local: int = 0  # real (unpadded) vocabulary entries on this rank

    def gather_full(self, grads: dict[str, torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
        """Logical-shape tensors from this rank's shards (for parity checks)."""
        out = {}
        for name, g in grads.items():
            split = self.split_dims.get(name)
            if split is None:
                out[name] = g
                continue
            dim, logical = split
            out[name] = comm.all_gather_tensor(g.contiguous(), self.tp, dim=dim).narrow(dim, 0, logical)
        return out


def _rows(weight: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    size = weight.shape[dim] // parts
    return weight.detach().narrow(dim, index * size, size).clone()


class ColumnParallelLinear(nn.Linear):
    """y_local = x W_local^T: this rank's output features; no communication."""


class RowParallelLinear(nn.Linear):
    """y = exit(x_local W_local^T): partial sums over the input features, reduced on the way out."""

    def __init__(
        self, in_features: int, out_features: int, exit_fn: Callable[[torch.Tensor], torch.Tensor] | None
    ):
        super().__init__(in_features, out_features, bias=False)
        self.exit_fn = exit_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return self.exit_fn(out) if self.exit_fn is not None else out


class KVHeadLinear(nn.Linear):
    """All K key/value heads (replicated on every tp rank) projected, then the one head this rank's query
    heads read kept: used when there are fewer key/value heads than tp ranks."""

    def __init__(self, source: nn.Linear, head: int, head_dim: int):
        super().__init__(source.in_features, source.out_features, bias=source.bias is not None)
        self.keep = slice(head * head_dim, (head + 1) * head_dim)
        with torch.no_grad():
            self.weight.copy_(source.weight)
            if source.bias is not None:
                self.bias.copy_(source.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., self.keep]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the (padded) embedding table; tokens elsewhere give zeros here and
    the exit (all-reduce or reduce-scatter) sums the one rank that holds each token."""

    def __init__(
        self, weight_local: torch.Tensor, start: int, exit_fn: Callable[[torch.Tensor], torch.Tensor]
    ):
        super().__init__()
        self.weight = nn.Parameter(weight_local)
        self.start, self.exit_fn = start, exit_fn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[..., None]
        return self.exit_fn(out)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits_NV: torch.Tensor,
        targets_N: torch.Tensor,
        start: int,
        valid: int,
        comm: Comm,
        tp: CommGroup,
    ) -> torch.Tensor:
        logits = logits_NV.float()
        if valid < logits.shape[-1]:  # padding entries of the vocabulary never win any probability
            logits = logits.clone()
            logits[:, valid:] = float("-inf")
        max_N = logits.max(dim=-1).values
        comm.all_reduce_(max_N, tp, op="max")
        shifted = logits - max_N[:, None]
        exp = shifted.exp()
        sum_exp_N = comm.all_reduce_(exp.sum(dim=-1), tp)
        local_target = targets_N - start
        inside = (local_target >= 0) & (local_target < valid)
        index = local_target.clamp(0, logits.shape[-1] - 1)
        picked_N = shifted.gather(1, index[:, None]).squeeze(1) * inside
        comm.all_reduce_(picked_N, tp)
        ctx.save_for_backward(exp / sum_exp_N[:, None], index, inside)
        ctx.input_dtype = logits_NV.dtype
        return sum_exp_N.log() - picked_N

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        softmax, index, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, index[:, None], -inside[:, None].to(grad.dtype))
        return (grad * grad_N[:, None]).to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, targets: torch.Tensor, plan: TensorParallelPlan, comm: Comm
) -> torch.Tensor:
    """Per-token cross-entropy [N] from this rank's slice of the vocabulary logits, without gathering
    them: three all-reduces of one number per token (max, sum of exponentials, target logit)."""
    return _VocabParallelCrossEntropy.apply(
        logits_local.flatten(0, -2), targets.flatten(), plan.vocab_start, plan.vocab_local, comm, plan.tp
    )


def apply_tensor_parallel(
    model: Transformer, comm: Comm, tp: CommGroup, sequence_parallel: bool
) -> TensorParallelPlan:
    """Shard `model` in place for this rank of `tp`; returns how each parameter was cut."""
    cfg = model.cfg
    n, r = tp.size, tp.rank
    plan = TensorParallelPlan(tp)
    if sequence_parallel:

        def enter(x: torch.Tensor) -> torch.Tensor:
            return comm.all_gather(x, tp, dim=1)

        def exit_(x: torch.Tensor) -> torch.Tensor:
            return comm.reduce_scatter(x, tp, dim=1)
    else:

        def enter(x: torch.Tensor) -> torch.Tensor:
            return comm.copy_to_group(x, tp)

        def exit_(x: torch.Tensor) -> torch.Tensor:
            return comm.reduce_from_group(x, tp)

    def column(linear: nn.Linear, name: str, out_features: int) -> ColumnParallelLinear:
        local = ColumnParallelLinear(linear.in_features, out_features // n, bias=linear.bias is not None)
        with torch.no_grad():
            local.weight.copy_(_rows(linear.weight, 0, r, n))
            if linear.bias is not None:
                local.bias.copy_(_rows(linear.bias, 0, r, n))
                plan.split_dims[f"{name}.bias"] = (0, out_features)
        plan.split_dims[f"{name}.weight"] = (0, out_features)
        return local

    def row(linear: nn.Linear, name: str, exit_fn: Callable | None) -> RowParallelLinear:
        local = RowParallelLinear(linear.in_features // n, linear.out_features, exit_fn)
        with torch.no_grad():
            local.weight.copy_(_rows(linear.weight, 1, r, n))
        plan.split_dims[f"{name}.weight"] = (1, linear.in_features)
        return local

    def replicated_partial(param: nn.Parameter) -> None:
        """A weight whole on every rank whose gradient each rank sees only part of: sum it over tp."""
        param.register_hook(lambda grad: comm.all_reduce_(grad.clone(), tp))

    def entering_norm(norm: RMSNorm, name: str) -> None:
        norm.register_forward_hook(lambda _m, _i, out: enter(out))
        if sequence_parallel:  # each rank normalises 1/tp of the tokens: its weight gradient is partial
            replicated_partial(norm.weight)

    for i, block in model.layers.items():
        prefix = f"layers.{i}"
        attn: Attention = block.attention
        entering_norm(block.attention_norm, f"{prefix}.attention_norm")
        kv_split = cfg.kv_heads % n == 0
        attn.wq = column(attn.wq, f"{prefix}.attention.wq", cfg.n_heads * cfg.head_size)
        for proj in ("wk", "wv"):
            name = f"{prefix}.attention.{proj}"
            if kv_split:
                setattr(attn, proj, column(getattr(attn, proj), name, cfg.kv_heads * cfg.head_size))
            else:
                kv_head = r * cfg.kv_heads // n
                setattr(attn, proj, KVHeadLinear(getattr(attn, proj), kv_head, cfg.head_size))
                for p in getattr(attn, proj).parameters():
                    replicated_partial(p)
        attn.wo = row(attn.wo, f"{prefix}.attention.wo", exit_)
        for qk in ("q_norm", "k_norm"):
            norm = getattr(attn, qk)
            if norm is not None:  # shared by all heads, of which this rank has some
                replicated_partial(norm.weight)

        entering_norm(block.ffn_norm, f"{prefix}.ffn_norm")
        if block.moe is None:
            ffn = block.feed_forward
            ffn.w1 = column(ffn.w1, f"{prefix}.feed_forward.w1", cfg.ffn_dim)
            ffn.w3 = column(ffn.w3, f"{prefix}.feed_forward.w3", cfg.ffn_dim)
            ffn.w2 = row(ffn.w2, f"{prefix}.feed_forward.w2", exit_)
        else:
            _shard_moe(
                block.moe,
                f"{prefix}.moe",
                cfg.expert_ffn_dim,
                cfg.shared_expert_ffn_dim,
                plan,
                exit_,
                column,
                row,
                replicated_partial,
            )

    if model.norm is not None:  # absent on pipeline stages without the head
        entering_norm(model.norm, "norm")
    padded_vocab = math.ceil(cfg.vocab_size / n) * n
    rows_per_rank = padded_vocab // n
    plan.vocab_start = r * rows_per_rank
    plan.vocab_local = max(0, min(rows_per_rank, cfg.vocab_size - plan.vocab_start))

    def vocab_shard(weight: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(padded_vocab, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[: cfg.vocab_size] = weight.detach()
        return padded[plan.vocab_start : plan.vocab_start + rows_per_rank].clone()

    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(
            vocab_shard(model.tok_embeddings.weight), plan.vocab_start, exit_
        )
        plan.split_dims["tok_embeddings.weight"] = (0, cfg.vocab_size)
    if model.output is not None:
        model.output.weight = nn.Parameter(vocab_shard(model.output.weight))
        plan.split_dims["output.weight"] = (0, cfg.vocab_size)
    return plan


def _shard_moe(
    moe: MoE,
    prefix: str,
    expert_ffn: int,
    shared_ffn: int,
    plan: TensorParallelPlan,
    exit_: Callable,
    column: Callable,
    row: Callable,
    replicated_partial: Callable,
) -> None:
    n, r = plan.tp.size, plan.tp.rank
    experts = moe.experts
    experts.w1 = nn.Parameter(_rows(experts.w1, 1, r, n))
    experts.w3 = nn.Parameter(_rows(experts.w3, 1, r, n))
    experts.w2 = nn.Parameter(_rows(experts.w2, 2, r, n))
    plan.split_dims.update(
        {
            f"{prefix}.experts.w1": (1, expert_ffn),
            f"{prefix}.experts.w3": (1, expert_ffn),
            f"{prefix}.experts.w2": (2, expert_ffn),
        }
    )
    # The routing weights multiply partial expert outputs, so the router's gradient is partial too; the
    # aux losses are computed identically on every rank, so each contributes 1/tp of their gradient.
    replicated_partial(moe.router.weight)
    moe.aux_loss_coef /= n
    moe.z_loss_coef /= n
    if moe.shared_experts is not None:
        shared = moe.shared_experts
        shared.w1 = column(shared.w1, f"{prefix}.shared_experts.w1", shared_ffn)
        shared.w3 = column(shared.w3, f"{prefix}.shared_experts.w3", shared_ffn)
        shared.w2 = row(shared.w2, f"{prefix}.shared_experts.w2", None)
        if moe.shared_gate is not None:
            replicated_partial(moe.shared_gate.weight)
    moe.register_forward_hook(lambda _m, _i, out: (exit_(out[0]), out[1]))
