"""Tensor parallel (Megatron-style) and sequence parallel over the tp group.

`apply_tensor_parallel` turns a built single-device model into this rank's shard of it, in place, by a
declarative plan (BLOCK_PLAN, MODEL_PLAN: module path -> how it is cut): each weight is replaced by its
slice of the same logical tensor (so initialisation and checkpoints are layout-independent), and the
layers' parameter names do not change.

  attention   wq, wk, wv column-parallel (this rank's H/tp query heads and K/tp key/value heads; when
              K < tp, every rank keeps all K key/value heads and uses the one its query heads read),
              wo row-parallel
  MLA         the up-projections wq_b, wkv_b (or wq) column-parallel: this rank's H/tp heads; wo row-
              parallel; the down-projections to the latents whole on every rank (the latents are small
              and every head reads all of them). With q_lora_rank > 0 nothing else reads the block's
              input, so the latents, not the input, enter the region, as Megatron-Core does: under sp
              each rank projects its own 1/tp of the tokens down and the latents are all-gathered
              (q_lora_rank + kv_lora_rank + qk_rope_head_dim values per token instead of dim, and no
              rank repeats another's down-projection); without q_lora_rank the input enters (wq needs
              it) and every rank projects the whole sequence down
  SwiGLU      w1, w3 column-parallel, w2 row-parallel
  MoE         router replicated; every expert's FFN split like SwiGLU (parallel.etp = tp), or with
              etp = 1 the experts left whole for expert parallel to place over the tp ranks too (each
              tp rank sends 1/tp of the gathered tokens to them: parallel/expert.py); either way the
              routed and shared outputs are combined while still partial, then reduced once
  embedding   vocab-parallel: rows [r*V/tp, (r+1)*V/tp) of the (padded) vocabulary
  head        vocab-parallel logits, and `vocab_parallel_cross_entropy` never gathers them

A tensor-parallel region starts where a norm's output enters the column-parallel layers and ends at
the row-parallel layer's output:

              enter (after attention_norm / ffn_norm / final norm)     exit (after wo / w2 / MoE / embedding)
  tp          copy forward, all-reduce backward  (Megatron's f)         all-reduce forward, copy backward (g)
  tp + sp     all-gather the sequence forward,                          reduce-scatter the sequence forward,
              reduce-scatter backward                                   all-gather backward

With sp the residual stream, the norms and the embedding output hold 1/tp of the sequence, and so does
what backward keeps: the projections that save the all-gathered input keep its shard, and backward
gathers it again, once per region (comm/saved_gathers.py, as Megatron does). Weights that
every tp rank holds whole but that see only part of the work (norms under sp, q/k norms, the router,
the shared-expert gate, replicated key/value projections) get a gradient hook that sums their gradient
over the tp group. Each tp rank back-propagates the same (replicated) loss, as in Megatron.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.kept_outputs import reusable
from meshtron.comm.saved_gathers import SAVED_GATHERS
from meshtron.config.schema import ModelConfig
from meshtron.models.layers import RMSNorm
from meshtron.models.llama import Transformer
from meshtron.models.loss import IGNORE_INDEX
from meshtron.models.moe import MoE


@dataclass
class TensorParallelPlan:
    """How each logical parameter was cut: the dim split over tp (None: whole on every rank) and its
    logical size along that dim (the vocabulary is padded to a multiple of tp)."""

    tp: CommGroup
    split_dims: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    vocab_start: int = 0
    vocab_local: int = 0  # real (unpadded) vocabulary entries on this rank
    # Whole on every tp rank, yet different on each: experts under etp = 1, which expert parallel places
    # over the tp ranks too (the gradient norm counts them on every tp rank).
    placed_by_ep: set[str] = field(default_factory=set)

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
        self,
        in_features: int,
        out_features: int,
        exit_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        device: torch.device | None = None,
    ):
        super().__init__(in_features, out_features, bias=False, device=device)
        self.exit_fn = exit_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return self.exit_fn(out) if self.exit_fn is not None else out


class KVHeadLinear(nn.Linear):
    """All K key/value heads (replicated on every tp rank) projected, then the one head this rank's query
    heads read kept: used when there are fewer key/value heads than tp ranks."""

    def __init__(self, source: nn.Linear, head: int, head_dim: int):
        bias, device = source.bias is not None, source.weight.device
        super().__init__(source.in_features, source.out_features, bias=bias, device=device)
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
        # Its rows as a plain int: reading the weight's shape would gather it under SimpleFSDP.
        self.start, self.rows, self.exit_fn = start, weight_local.shape[0], exit_fn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside[..., None]
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
        # An ignored target (IGNORE_INDEX, outside every rank's range) has no loss and no gradient: its
        # softmax row is zeroed, so nothing more is saved for it.
        counts_N = targets_N != IGNORE_INDEX
        ctx.save_for_backward((exp / sum_exp_N[:, None]) * counts_N[:, None], index, inside)
        ctx.input_dtype = logits_NV.dtype
        return (sum_exp_N.log() - picked_N) * counts_N

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
    them: three all-reduces of one number per token (max, sum of exponentials, target logit). 0 (and no
    gradient) where the target is IGNORE_INDEX."""
    return _VocabParallelCrossEntropy.apply(
        logits_local.flatten(0, -2), targets.flatten(), plan.vocab_start, plan.vocab_local, comm, plan.tp
    )


# How each module of a transformer block is cut over tp, by its path inside the block (modules a block
# does not have, such as q_norm without qk_norm, are skipped):
#   entering     a norm whose output enters a tp region (copy / all-gather the sequence under sp); under
#                sp each rank normalises 1/tp of the tokens, so its weight's gradient is summed over tp
#   column       output features split: this rank's query heads, key/value heads or FFN columns
#   kv_column    column when tp divides the key/value heads; otherwise all of them kept (replicated),
#                each rank selecting the head its query heads read
#   row          input features split; the partial sums are reduced on the way out (the region's exit)
#   inner_row    row, where the block goes on after the exit (the attention's wo): a rerun of the block's
#                forward under per-op recompute reads the reduced output, so under sp the forward's
#                reduce-scatter output is kept for it (comm/kept_outputs.py) instead of sent again; the
#                FFN's and MoE's exits end the block, where the rerun has stopped
#   partial_row  row, left partial: the MoE output reduces the routed and shared parts once, together
#   replicated   whole on every rank but fed part of the work: gradient summed over tp
#   on_shards    whole weights on the residual stream, outside any region (MLA's attention_norm: the
#                latents enter the region after it; an MTP depth's norms and projection): under sp each
#                rank sees its own tokens, so their gradients are summed over tp
#   entering_linear  whole on every rank, its output enters the region (MLA's down-projections): under sp
#                it projects this rank's tokens and the latents are gathered, its gradient summed over tp
#   experts      every expert's SwiGLU split like column, column, row (etp = tp), or left whole (etp = 1)
#   moe_exit     the MoE output (partial) leaves the region; its aux losses count 1/tp on each rank
BLOCK_PLAN: dict[str, str] = {
    "attention_norm": "entering",
    "attention.wq": "column",
    "attention.wk": "kv_column",
    "attention.wv": "kv_column",
    "attention.wo": "inner_row",
    "attention.q_norm": "replicated",
    "attention.k_norm": "replicated",
    "ffn_norm": "entering",
    "feed_forward.w1": "column",
    "feed_forward.w3": "column",
    "feed_forward.w2": "row",
    "moe.experts": "experts",
    "moe.router": "replicated",
    "moe.shared_experts.w1": "column",
    "moe.shared_experts.w3": "column",
    "moe.shared_experts.w2": "partial_row",
    "moe.shared_gate": "replicated",
    "moe": "moe_exit",
}
# A latent-attention block with q_lora_rank > 0: the latents enter the region, not the input.
LATENT_ENTRY_PLAN: dict[str, str] = {
    **BLOCK_PLAN,
    "attention_norm": "on_shards",
    "attention.wq_a": "entering_linear",
    "attention.q_latent_norm": "replicated",
    "attention.wq_b": "column",
    "attention.wkv_a": "entering_linear",
    "attention.kv_latent_norm": "replicated",
    "attention.wkv_b": "column",
}
# ...and without q_lora_rank: the input enters, the latent's projection and norm replicated.
LATENT_FULL_Q_PLAN: dict[str, str] = {
    **BLOCK_PLAN,
    "attention.wkv_a": "replicated",
    "attention.kv_latent_norm": "replicated",
    "attention.wkv_b": "column",
}
# A multi-token prediction depth around its block: its input norms and projection work on the residual
# stream (whole weights, every rank's tokens under sp); its final norm enters the head's region.
MTP_PLAN: dict[str, str] = {
    "enorm": "on_shards",
    "hnorm": "on_shards",
    "eh_proj": "on_shards",
    "norm": "entering",
}
# Outside the blocks: the vocabulary is split over tp (padded to a multiple of it).
MODEL_PLAN: dict[str, str] = {"norm": "entering", "tok_embeddings": "vocab_embedding", "output": "vocab_head"}


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = root
    for part in path.split(".") if path else ():
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


class _Sharder:
    """Applies the plans' styles on this rank of `tp`, recording how each parameter was cut."""

    def __init__(
        self, cfg: ModelConfig, comm: Comm, tp: CommGroup, sequence_parallel: bool, expert_tp: bool = True
    ):
        self.cfg, self.comm, self.tp, self.sp = cfg, comm, tp, sequence_parallel
        self.expert_tp = expert_tp
        self.n, self.r = tp.size, tp.rank
        self.plan = TensorParallelPlan(tp)
        self.padded_vocab = math.ceil(cfg.vocab_size / self.n) * self.n
        self.plan.vocab_start = self.r * (self.padded_vocab // self.n)
        self.plan.vocab_local = max(
            0, min(self.padded_vocab // self.n, cfg.vocab_size - self.plan.vocab_start)
        )

    def apply(self, root: nn.Module, plan: dict[str, str], prefix: str) -> None:
        self.in_moe_block = isinstance(_resolve(root, "moe"), MoE)
        for path, style in plan.items():
            module = _resolve(root, path)
            if module is None:
                continue
            replacement = getattr(self, style)(module, f"{prefix}.{path}" if prefix else path)
            if replacement is not None:
                parent, _, leaf = path.rpartition(".")
                setattr(_resolve(root, parent), leaf, replacement)

    def enter_region(self, x: torch.Tensor, cast: bool = False) -> torch.Tensor:
        """Megatron's f (tp) or the sequence all-gather (sp). Under sp the projections that save the
        gathered input keep its shard instead and gather it again in backward (comm/saved_gathers.py);
        `cast`: gather in autocast's dtype, as every consumer would cast it, so that they share one copy
        (and half the bytes move)."""
        if not self.sp:
            return self.comm.copy_to_group(x, self.tp)
        if cast and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        gathered = self.comm.all_gather(x, self.tp, dim=1)
        if torch.is_grad_enabled():
            SAVED_GATHERS.track(gathered, x, lambda shard: self.comm.all_gather_tensor(shard, self.tp, dim=1))
        return gathered

    def exit_region(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.comm.reduce_scatter(x, self.tp, dim=1)
            if self.sp
            else self.comm.reduce_from_group(x, self.tp)
        )

    def exit_region_reusable(self, x: torch.Tensor) -> torch.Tensor:
        """exit_region, its sp reduce-scatter kept for a rerun (the all-reduce without sp is not: its
        output would be a second whole T·h copy beside the kept partial sum, as torchtitan's policy)."""
        if not self.sp:
            return self.exit_region(x)
        with reusable("tp"):
            return self.exit_region(x)

    def sum_gradient(self, param: nn.Parameter) -> None:
        plan = weakref.proxy(self)  # see FullyShardedDataParallel's hooks (engines/fsdp.py)

        def summed(grad: torch.Tensor) -> torch.Tensor:  # summed in fp32 (a bf16 parameter's too)
            return plan.comm.all_reduce_(grad.to(torch.float32, copy=True), plan.tp).to(grad.dtype)

        param.register_hook(summed)
        # An engine that stores the parameter as a new tensor re-registers it there (engines/simple_fsdp.py).
        param.grad_hooks = [*getattr(param, "grad_hooks", []), summed]

    def entering(self, norm: RMSNorm, name: str) -> None:
        # An MoE layer returns its (fp32-combined) output in its input's dtype: gathered in bf16, it would
        # round what one device keeps in fp32. That region gathers the norm's output as it is, so under
        # bf16 its consumers keep their own bf16 casts (not regathered: docs/tensor-parallel.md).
        cast = not (name.endswith("ffn_norm") and self.in_moe_block)
        norm.register_forward_hook(lambda _m, _i, out: self.enter_region(out, cast))
        if self.sp:
            self.sum_gradient(norm.weight)

    def on_shards(self, module: nn.Module, name: str) -> None:
        if self.sp:
            for param in module.parameters():
                self.sum_gradient(param)

    def entering_linear(self, linear: nn.Linear, name: str) -> None:
        linear.register_forward_hook(lambda _m, _i, out: self.enter_region(out))
        if self.sp:
            self.sum_gradient(linear.weight)
            linear.tokens_split = True  # (float8: its x and dy span the tp ranks' tokens)

    def column(self, linear: nn.Linear, name: str) -> ColumnParallelLinear:
        n, r, out_features = self.n, self.r, linear.out_features
        bias, device = linear.bias is not None, linear.weight.device  # meta when built on the meta device
        local = ColumnParallelLinear(linear.in_features, out_features // n, bias=bias, device=device)
        with torch.no_grad():
            local.weight.copy_(_rows(linear.weight, 0, r, n))
            if linear.bias is not None:
                local.bias.copy_(_rows(linear.bias, 0, r, n))
                self.plan.split_dims[f"{name}.bias"] = (0, out_features)
        self.plan.split_dims[f"{name}.weight"] = (0, out_features)
        return local

    def kv_column(self, linear: nn.Linear, name: str) -> nn.Linear:
        if self.cfg.kv_heads % self.n == 0:
            return self.column(linear, name)
        local = KVHeadLinear(linear, self.r * self.cfg.kv_heads // self.n, self.cfg.head_size)
        for param in local.parameters():
            self.sum_gradient(param)
        return local

    def row(self, linear: nn.Linear, name: str) -> RowParallelLinear:
        in_local, device = linear.in_features // self.n, linear.weight.device
        local = RowParallelLinear(in_local, linear.out_features, self.exit_region, device)
        with torch.no_grad():
            local.weight.copy_(_rows(linear.weight, 1, self.r, self.n))
        self.plan.split_dims[f"{name}.weight"] = (1, linear.in_features)
        return local

    def inner_row(self, linear: nn.Linear, name: str) -> RowParallelLinear:
        local = self.row(linear, name)
        local.exit_fn = self.exit_region_reusable
        return local

    def partial_row(self, linear: nn.Linear, name: str) -> RowParallelLinear:
        local = self.row(linear, name)
        local.exit_fn = None
        return local

    def replicated(self, module: nn.Module, name: str) -> None:
        for param in module.parameters():
            self.sum_gradient(param)

    def experts(self, experts: nn.Module, name: str) -> None:
        n, r = self.n, self.r
        if not self.expert_tp:  # whole experts (etp = 1): expert parallel places them, tp ranks included
            self.plan.placed_by_ep.update(f"{name}.{w}" for w in ("w1", "w3", "w2"))
            return
        ffn = experts.w1.shape[1]
        experts.w1 = nn.Parameter(_rows(experts.w1, 1, r, n))
        experts.w3 = nn.Parameter(_rows(experts.w3, 1, r, n))
        experts.w2 = nn.Parameter(_rows(experts.w2, 2, r, n))
        self.plan.split_dims.update({f"{name}.w1": (1, ffn), f"{name}.w3": (1, ffn), f"{name}.w2": (2, ffn)})

    def moe_exit(self, moe: MoE, name: str) -> None:
        # The aux losses are computed identically on every rank, so each contributes 1/tp of their gradient.
        moe.aux_loss_coef /= self.n
        moe.z_loss_coef /= self.n
        moe.register_forward_hook(lambda _m, _i, out: (self.exit_region(out[0]), out[1]))

    def _vocab_shard(self, weight: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.padded_vocab, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[: self.cfg.vocab_size] = weight.detach()
        start, rows = self.plan.vocab_start, self.padded_vocab // self.n
        return padded[start : start + rows].clone()

    def vocab_embedding(self, embedding: nn.Embedding, name: str) -> VocabParallelEmbedding:
        self.plan.split_dims[f"{name}.weight"] = (0, self.cfg.vocab_size)
        return VocabParallelEmbedding(
            self._vocab_shard(embedding.weight), self.plan.vocab_start, self.exit_region
        )

    def vocab_head(self, output: nn.Linear, name: str) -> None:
        output.weight = nn.Parameter(self._vocab_shard(output.weight))
        self.plan.split_dims[f"{name}.weight"] = (0, self.cfg.vocab_size)


def apply_tensor_parallel(
    model: Transformer, comm: Comm, tp: CommGroup, sequence_parallel: bool, expert_tp: bool = True
) -> TensorParallelPlan:
    """Shard `model` in place for this rank of `tp` by BLOCK_PLAN and MODEL_PLAN; returns how each
    parameter was cut. `expert_tp`: split each expert's FFN over tp (else whole experts per rank)."""
    sharder = _Sharder(model.cfg, comm, tp, sequence_parallel, expert_tp)
    cfg = model.cfg
    plan = BLOCK_PLAN if not cfg.is_mla else LATENT_ENTRY_PLAN if cfg.q_lora_rank else LATENT_FULL_Q_PLAN
    for name, block in model.blocks():
        sharder.apply(block, plan, name)
    for name, module in (model.mtp or {}).items():
        sharder.apply(module, MTP_PLAN, f"mtp.{name}")
    sharder.apply(model, MODEL_PLAN, "")
    if sequence_parallel:  # (under pp, the pipeline's chunks are hooked: runtime.py)
        SAVED_GATHERS.hook(model)
    return sharder.plan
