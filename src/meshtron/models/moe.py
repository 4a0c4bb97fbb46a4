"""Mixture-of-experts feed-forward: top-k router, grouped expert GEMM, shared experts, balancing.

Shapes in names: T tokens (B*S flattened), D model dim, E experts, k top-k, N kept (token, choice)
assignments sorted by expert, F expert ffn dim, G statistics groups (1, or the B sequences).

A forward, on one device or on any layout:

  route      fp32 scores; top-k chosen on the scores plus the balancing bias (if any), among the best
             expert groups (if group-limited); gate weights from the unbiased scores
  keep       dropless, or with a capacity C = ceil(T*k/E*factor) per expert over this micro-batch,
             the lowest-scored assignments of an over-full expert dropped (the token keeps its
             residual path and the shared experts)
  dispatch   `local_dispatch` here: assignments sorted by expert (a stable sort), the experts run as one
             grouped matmul, each row's gate value folded into its SwiGLU before the down-projection
             (`WeightedSwiGLU`, Megatron-Core's weighted SwiGLU), the rows summed per token in fp32
             (`sum_rows`). Expert parallel replaces it (`MoE.dispatch`) with an exchange over the ep
             ranks (parallel/expert.py), the gate values travelling with the rows
  balance    Switch/GShard loss over the micro-batch, or DeepSeek-V3's per sequence; router z-loss
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config.schema import ModelConfig, RouterScore
from meshtron.models.layers import FeedForward, swiglu_grads


class _LoadCounting(threading.local):
    """Whether forwards count expert loads: not while activation recompute reruns one. Per thread: a
    pipeline may recompute one micro-batch in backward while another thread runs a counted forward."""

    on = True


_LOAD_COUNTING = _LoadCounting()


@contextlib.contextmanager
def loads_not_counted() -> Iterator[None]:
    before, _LOAD_COUNTING.on = _LOAD_COUNTING.on, False
    try:
        yield
    finally:
        _LOAD_COUNTING.on = before


class Router(nn.Module):
    """Scores each token against every expert and keeps the top k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.score_fn, self.norm_topk = cfg.top_k, cfg.router, cfg.router_norm_topk
        self.scale, self.groups, self.best_groups = (
            cfg.router_scale,
            cfg.n_expert_groups,
            cfg.topk_expert_groups,
        )
        self.bias_rate = cfg.router_bias_rate
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        # Auxiliary-loss-free balancing: steers the choice, never the gate values; no gradient.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if cfg.has_expert_bias else None)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T,k], expert ids [T,k], scores [T,E], logits [T,E]); routing is done in fp32."""
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.softmax(-1) if self.score_fn == "softmax" else logits_TE.sigmoid()
        choice_TE = scores_TE.detach() if self.expert_bias is None else scores_TE.detach() + self.expert_bias
        if self.groups > 1:
            choice_TE = self._best_groups_only(choice_TE)
        experts_Tk = choice_TE.topk(self.top_k, dim=-1).indices
        weights_Tk = scores_TE.gather(1, experts_Tk)
        if self.norm_topk:
            weights_Tk = weights_Tk / weights_Tk.sum(-1, keepdim=True)
        return weights_Tk * self.scale, experts_Tk, scores_TE, logits_TE

    def _best_groups_only(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing: a group scores the sum of its best two experts (its best
        one if it has one), and only the experts of each token's best `best_groups` groups can be chosen."""
        n_tokens, n_experts = choice_TE.shape
        per_group = n_experts // self.groups
        grouped = choice_TE.view(n_tokens, self.groups, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        best = group_score.topk(self.best_groups, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return choice_TE.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """One step of auxiliary-loss-free balancing from the global batch's expert loads: raise the bias
        of underloaded experts, lower it for overloaded ones, by bias_rate times the sign; kept zero-mean."""
        if self.bias_rate == 0:  # a checkpoint's bias, kept as it is
            return
        load_E = load_E.float()
        self.expert_bias += self.bias_rate * torch.sign(load_E.mean() - load_E)
        self.expert_bias -= self.expert_bias.mean()


def router_losses(
    scores_TE: torch.Tensor,
    experts_Tk: torch.Tensor,
    logits_TE: torch.Tensor,
    score_fn: RouterScore,
    token_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_z: bool = True,
    n_sequences: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) over the micro-batch's tokens.

    Load balancing is Switch-style, E * sum_e f_e * P_e, with f_e = assignments to e per token (sums to
    k, as Mixtral's reference counts it) and P_e the mean routing probability of e. With `n_sequences`
    > 0 it is DeepSeek-V3's sequence-wise loss instead: the same statistics per sequence, divided by k
    (so 1 when balanced) and averaged over the sequences. The z-loss (ST-MoE) is the mean squared
    log-sum-exp of the router logits. All are formed from per-expert sums and token counts, which
    `token_sum` (context parallel's sum over the ranks that split the sequences) completes when this rank
    holds only part of the micro-batch's tokens. Without `with_z` the z-loss is 0.
    """
    n_tokens, n_experts = scores_TE.shape
    groups = max(n_sequences, 1)
    group_T = torch.arange(n_tokens, device=scores_TE.device) // (n_tokens // groups)
    slots = (group_T[:, None] * n_experts + experts_Tk).flatten()
    counts_GE = counts_of(slots, groups * n_experts).to(scores_TE.dtype)
    probs_TE = scores_TE if score_fn == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
    z_sum = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() if with_z else logits_TE.new_zeros(())
    n_G = scores_TE.new_full((groups,), float(n_tokens // groups))
    stats = torch.cat([counts_GE, probs_TE.view(groups, -1, n_experts).sum(1).flatten(), z_sum[None], n_G])
    if token_sum is not None:
        stats = token_sum(stats)
    size = groups * n_experts
    counts_GE, probs_GE = stats[:size].view(groups, -1), stats[size : 2 * size].view(groups, -1)
    n_G = stats[-groups:]
    balance_G = n_experts * torch.sum(counts_GE / n_G[:, None] * (probs_GE / n_G[:, None]), dim=1)
    if n_sequences:
        balance_G = balance_G / experts_Tk.shape[1]
    return balance_G.mean(), stats[2 * size] / n_G.sum()


def capacity_keep(scores_TE: torch.Tensor, experts_Tk: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """[T,k] bool: the assignments kept. Dropless (capacity None) keeps all; otherwise each expert keeps
    its `capacity` highest-scored assignments (ties: earlier tokens first)."""
    if capacity is None:
        return torch.ones_like(experts_Tk, dtype=torch.bool)
    flat_experts = experts_Tk.flatten()
    by_score = torch.argsort(scores_TE.detach().gather(1, experts_Tk).flatten(), descending=True, stable=True)
    order = by_score[torch.argsort(flat_experts[by_score], stable=True)]
    counts_E = counts_of(flat_experts, scores_TE.shape[1])
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    place = torch.arange(order.numel(), device=order.device) - starts_E[flat_experts[order]]
    keep = torch.zeros_like(flat_experts, dtype=torch.bool)
    keep[order] = place < capacity
    return keep.view_as(experts_Tk)


def counts_of(ids: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[n] int64: how many of `ids` (weighted by 0/1 `weights`) are each of 0..n-1. bincount's result,
    without its read of the largest id on the host (a device synchronisation on GPUs)."""
    ones = torch.ones_like(ids) if weights is None else weights.to(ids.dtype)
    return torch.zeros(n, dtype=ids.dtype, device=ids.device).index_add_(0, ids, ones)


def sort_by_expert(
    experts_Tk: torch.Tensor, keep_Tk: torch.Tensor, first: int, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids into the flattened [T*k] assignments, sorted by expert, of the kept assignments to experts
    [first, first + n_experts); their count per expert [n_experts]). A stable sort: token order within
    an expert."""
    local = experts_Tk.flatten() - first
    ids = (keep_Tk.flatten() & (local >= 0) & (local < n_experts)).nonzero().squeeze(1)
    order = ids[torch.argsort(local[ids], stable=True)]
    return order, counts_of(local[ids], n_experts)


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype the experts compute in (autocast's, if on): what dispatch sends."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class _AddRows(torch.autograd.Function):
    """out[row_N[n]] += y[n] into zeros [n_rows, D], in fp32 (or wider) when `wide`, else in y's dtype.
    The row ids are kept on ctx, not saved for backward: see `take_rows`."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, row_N: torch.Tensor, n_rows: int, wide: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.row_N, ctx.dtype = row_N, y_ND.dtype
        if wide:
            y_ND = y_ND.to(torch.promote_types(y_ND.dtype, torch.float32))
        return y_ND.new_zeros(n_rows, *y_ND.shape[1:]).index_add_(0, row_N, y_ND)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        return grad[ctx.row_N].to(ctx.dtype), None, None, None


class _TakeRows(torch.autograd.Function):
    """y[row_N], the row ids kept on ctx: see `take_rows`."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, row_N: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.row_N, ctx.rows = row_N, y_ND.shape[0]
        return y_ND[row_N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add_(0, ctx.row_N, grad), None


def sum_rows(y_ND: torch.Tensor, row_N: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[n_rows, D] in fp32 (or wider): the rows of y_ND summed into row row_N[n] of the result (a token's
    already weighted expert outputs)."""
    return _AddRows.apply(y_ND, row_N, n_rows, True)


def put_rows(y_ND: torch.Tensor, row_N: torch.Tensor) -> torch.Tensor:
    """The rows of y_ND put back where a permutation took them from: out[row_N[n]] = y[n], in y's dtype."""
    return _AddRows.apply(y_ND, row_N, y_ND.shape[0], False)


def take_rows(y_ND: torch.Tensor, row_N: torch.Tensor) -> torch.Tensor:
    """y_ND[row_N]. What runs after the experts' down-projection (these two, the combine's exchanges,
    casts, pads and sums) saves no tensor for backward: the row ids ride on ctx (they are saved anyway
    by the gathers before the experts). So recompute = "op" (torch's non-reentrant checkpoint, which
    stops rerunning a block once every saved tensor is made again) stops before the down-projection,
    whose output it then need not keep (parallel/recompute.py)."""
    return _TakeRows.apply(y_ND, row_N)


class WeightedSwiGLU(torch.autograd.Function):
    """silu(gate)·up·w, computed in fp32 (or wider) and returned in gate's dtype, with w [...] each row's
    gate value: the routing weight folded into an expert's activation before its down-projection
    (Megatron-Core's weighted SwiGLU), so the down-projection's output is already weighted and nothing of
    model width is kept for the weight's gradient. Backward keeps gate, up and w and makes the product
    again."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up, w)
        wide = torch.promote_types(gate.dtype, torch.float32)
        return (F.silu(gate.to(wide)) * up.to(wide) * w.to(wide)[..., None]).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        gate, up, w = ctx.saved_tensors
        wide = torch.promote_types(gate.dtype, torch.float32)
        g, u, grad = gate.to(wide), up.to(wide), grad.to(wide)
        grad_gate, grad_up, silu = swiglu_grads(g, u, grad * w.to(wide)[..., None])
        grad_w = (grad * silu * u).sum(-1).to(w.dtype)
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype), grad_w


# Eager even inside compiled blocks: the compiler has no fp32 grouped_mm (torch 2.13's meta kernel
# takes bf16 only), and the loop reads the counts on the host. torch's own lazy form of
# torch.compiler.disable: that one imports the compiler (dynamo, sympy, FSDP, DTensor) when this module
# loads, a second or more of every run's start-up (issue 45.13); this one at the first call.
@torch._disable_dynamo
def grouped_linear(x_ND: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[n] = x[n] W_e^T for the expert e of row n (rows sorted by expert, counts_E of each): one grouped
    matmul (torch's grouped_mm, in the autocast dtype), or a loop over experts where it does not apply
    (its rows must be multiples of 16 bytes; fp64 is not among its dtypes)."""
    device = x_ND.device.type
    x_ND = compute_dtype(x_ND)
    dtype = x_ND.dtype
    w_EOI = w_EOI.to(dtype)
    row_bytes = torch.finfo(dtype).bits // 8
    grouped = dtype in (torch.float32, torch.bfloat16, torch.float16)
    if grouped and all(d * row_bytes % 16 == 0 for d in w_EOI.shape[1:]):
        offsets = torch.cumsum(counts_E, 0).to(torch.int32)
        with torch.autocast(device, enabled=False):
            y_NO = F.grouped_mm(x_ND.contiguous(), w_EOI.transpose(1, 2), offs=offsets)
        if y_NO.requires_grad:  # its backward needs a dense gradient (not an expanded one)
            y_NO.register_hook(torch.Tensor.contiguous)
        return y_NO
    chunks = x_ND.split(counts_E.tolist())
    return torch.cat([x @ w.T for x, w in zip(chunks, w_EOI, strict=True)]) if chunks else x_ND[:, :0]


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights, computed over rows sorted by expert."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # down

    def forward(
        self, x_ND: torch.Tensor, counts_E: torch.Tensor | None, gates_N: torch.Tensor
    ) -> torch.Tensor:
        """Each row's output weighted by its gate value (gates_N, fp32): rows sorted by expert, counts_E of
        each; or counts_E None: x is [E, M, D] and gates [E, M], M rows per expert."""
        if counts_E is None:
            return self.forward_slots(x_ND, gates_N)
        gate = grouped_linear(x_ND, self.w1, counts_E)
        up = grouped_linear(x_ND, self.w3, counts_E)
        return self.down(WeightedSwiGLU.apply(gate, up, gates_N), counts_E)

    def forward_slots(self, x_EMD: torch.Tensor, gates_EM: torch.Tensor) -> torch.Tensor:
        """Every expert on its own M rows (capacity slots; empty ones zero, and so their outputs): batched
        matmuls of static shapes, nothing read on the host."""
        x_EMD = compute_dtype(x_EMD)
        gate, up = (torch.bmm(x_EMD, w.to(x_EMD.dtype).transpose(1, 2)) for w in (self.w1, self.w3))
        return self.down(WeightedSwiGLU.apply(gate, up, gates_EM), None)

    def down(self, h: torch.Tensor, counts_E: torch.Tensor | None) -> torch.Tensor:
        """The down-projection w2 of the weighted activations: grouped by counts_E, or batched [E, M, F]
        (counts_E None). Its own method, so that recompute can tell its matmul from the others'."""
        if counts_E is None:
            return torch.bmm(h, self.w2.to(h.dtype).transpose(1, 2))
        return grouped_linear(h, self.w2, counts_E)


class Routing(NamedTuple):
    """Where a micro-batch's tokens go: gate weights [T,k] (fp32), expert ids [T,k], which of those
    assignments are kept [T,k] (all, unless a capacity drops some), and the capacity per expert they were
    kept under (None: dropless)."""

    weights_Tk: torch.Tensor
    experts_Tk: torch.Tensor
    keep_Tk: torch.Tensor
    capacity: int | None = None

    def rows(self, start: int, stop: int) -> Routing:
        """The routing of tokens [start, stop) (under the same capacity). The gates are copied: a view
        saved for backward would keep every token's gates alive."""
        weights_Tk = self.weights_Tk[start:stop].clone()
        return Routing(weights_Tk, self.experts_Tk[start:stop], self.keep_Tk[start:stop], self.capacity)


def local_dispatch(moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
    """[T, D] fp32: this rank's experts (all of them, or under expert tensor parallel its share, the
    others' outputs summed by tensor parallel's exit) on this rank's tokens."""
    weights_Tk, experts_Tk, keep_Tk, _ = routing
    order, counts_E = sort_by_expert(experts_Tk, keep_Tk, moe.first_expert, moe.local_experts)
    token_N = order // moe.top_k
    y_ND = moe.experts(x_TD[token_N], counts_E, weights_Tk.flatten()[order])
    return sum_rows(y_ND, token_N, x_TD.shape[0])


class MoE(nn.Module):
    """Routed experts plus optional shared experts; forward returns (output, weighted aux loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.per_sequence = cfg.capacity_factor, cfg.balance_loss == "sequence"
        self.aux_loss_coef, self.z_loss_coef, self.score_fn = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.router
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared_experts = None
        self.shared_gate = None
        if cfg.n_shared_experts:
            self.shared_experts = FeedForward(cfg.dim, cfg.shared_expert_ffn_dim)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)
        # The seams parallelisms fill in. `first_expert` and `local_experts`: the id of this rank's first
        # expert and how many it holds when it holds a range of them (expert parallel; a plain int, since
        # reading a sharded stack's shape would gather it under SimpleFSDP); `dispatch`: how tokens reach
        # the experts (expert parallel); `token_sum`: sums routing statistics over the ranks holding the
        # rest of the micro-batch's tokens (context parallel).
        self.first_expert, self.local_experts = 0, cfg.n_experts
        self.dispatch: Callable[..., torch.Tensor] = local_dispatch
        self.token_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Assignments routed to / kept by each expert since the last `take_loads` (metrics, bias updates).
        self.register_buffer("loads_2E", torch.zeros(2, cfg.n_experts), persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """The buffers' initial values on `device`: no loads counted, a zero balancing bias."""
        self.loads_2E = torch.zeros(2, self.n_experts, device=device)
        if self.router.expert_bias is not None:
            self.router.expert_bias = torch.zeros(self.n_experts, device=device)

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    @torch.no_grad()
    def _count(self, experts_Tk: torch.Tensor, keep_Tk: torch.Tensor) -> None:
        if _LOAD_COUNTING.on:
            self.loads_2E[0] += counts_of(experts_Tk.flatten(), self.n_experts)
            self.loads_2E[1] += counts_of(experts_Tk.flatten(), self.n_experts, keep_Tk.flatten())

    def take_loads(self) -> torch.Tensor:
        """[2, E]: (routed, kept) assignments per expert counted since the last call; resets them."""
        loads = self.loads_2E.clone()
        self.loads_2E.zero_()
        return loads

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, weighted auxiliary loss). The routed experts run last, so that nothing after their
        down-projection is kept for backward (`take_rows`)."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_Tk, experts_Tk, scores_TE, logits_TE = self.router(x_TD)
        capacity = self.capacity(x_TD.shape[0])
        keep_Tk = capacity_keep(scores_TE, experts_Tk, capacity)
        self._count(experts_Tk, keep_Tk)
        aux = self._aux_loss(x_BSD, scores_TE, experts_Tk, logits_TE)
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_TD)) * shared
        y_TD = self.dispatch(self, x_TD, Routing(weights_Tk, experts_Tk, keep_Tk, capacity)).to(x_TD.dtype)
        if shared is not None:
            y_TD = y_TD + shared
        return y_TD.view_as(x_BSD), aux

    def _aux_loss(
        self, x_BSD: torch.Tensor, scores_TE: torch.Tensor, experts_Tk: torch.Tensor, logits_TE: torch.Tensor
    ) -> torch.Tensor:
        """The balance loss (and the router z-loss) times their coefficients."""
        balance, z_loss = router_losses(
            scores_TE,
            experts_Tk,
            logits_TE,
            self.score_fn,
            self.token_sum,
            with_z=bool(self.z_loss_coef),
            n_sequences=x_BSD.shape[0] if self.per_sequence else 0,
        )
        aux = self.aux_loss_coef * balance
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * z_loss
        return aux
