"""Mixture-of-experts feed-forward: top-k router, grouped expert GEMM, shared experts, aux losses.

Shapes in names: T tokens (B*S flattened), D model dim, E experts, k top-k, C per-expert capacity
(the longest expert queue when dropless), F expert ffn dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig, RouterScore
from meshtron.models.layers import FeedForward


def moe_problems(cfg: ModelConfig) -> list[str]:
    """What routing needs of an MoE model's options (none for a dense model)."""
    if not cfg.is_moe:
        return []
    problems = []
    if not 1 <= cfg.top_k <= cfg.n_experts:
        problems.append(f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}")
    if cfg.moe_every < 1:
        problems.append(f"model.moe_every={cfg.moe_every} must be >= 1")
    outside = [i for i in cfg.dense_layers if not 0 <= i < cfg.n_layers]
    if outside:
        problems.append(f"model.dense_layers {outside} are outside 0..{cfg.n_layers - 1}")
    if cfg.shared_expert_gate and cfg.n_shared_experts == 0:
        problems.append("model.shared_expert_gate=true needs model.n_shared_experts >= 1")
    return problems


class Router(nn.Module):
    """Scores each token against every expert and keeps the top k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.score_fn, self.norm_topk = cfg.top_k, cfg.router, cfg.router_norm_topk
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T,k], expert ids [T,k], scores [T,E], logits [T,E]); routing is done in fp32."""
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.softmax(-1) if self.score_fn == "softmax" else logits_TE.sigmoid()
        weights_Tk, experts_Tk = scores_TE.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights_Tk = weights_Tk / weights_Tk.sum(-1, keepdim=True)
        return weights_Tk, experts_Tk, scores_TE, logits_TE


def router_losses(
    scores_TE: torch.Tensor,
    experts_Tk: torch.Tensor,
    logits_TE: torch.Tensor,
    score_fn: RouterScore,
    token_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_z: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) over the micro-batch's tokens.

    Load balancing is Switch-style, E * sum_e f_e * P_e, with f_e = assignments to e per token (sums to
    k, as Mixtral's reference counts it) and P_e the mean routing probability of e; the z-loss (ST-MoE)
    is the mean squared log-sum-exp of the router logits, keeping the softmax well conditioned. Both are
    formed from per-expert sums and a token count, which `token_sum` (context parallel's sum over the
    ranks that split the sequence) completes when a rank holds only part of the micro-batch's tokens.
    Without `with_z` the z-loss is not computed (returned as 0).
    """
    n_experts = scores_TE.shape[1]
    counts_E = torch.bincount(experts_Tk.flatten(), minlength=n_experts).to(scores_TE.dtype)
    probs_TE = scores_TE if score_fn == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
    z_sum = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() if with_z else logits_TE.new_zeros(())
    n_tokens = torch.tensor([float(scores_TE.shape[0])], device=scores_TE.device)
    stats = torch.cat([counts_E, probs_TE.sum(0), z_sum[None], n_tokens])
    if token_sum is not None:
        stats = token_sum(stats)
    counts_E, prob_sums_E, z_sum, n = stats[:n_experts], stats[n_experts:-2], stats[-2], stats[-1]
    return n_experts * torch.sum(counts_E / n * (prob_sums_E / n)), z_sum / n


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights, computed with batched matmuls over per-expert queues."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # down

    def forward(self, x_ECD: torch.Tensor) -> torch.Tensor:
        gate = torch.bmm(x_ECD, self.w1.transpose(1, 2))
        up = torch.bmm(x_ECD, self.w3.transpose(1, 2))
        return torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))


def dispatch_plan(experts_Tk: torch.Tensor, n_experts: int, capacity: int | None) -> tuple[torch.Tensor, ...]:
    """Where each kept (token, choice) assignment sits in the [E, C] expert queues.

    Returns (assignment ids into the flattened [T*k], expert id, slot in that expert's queue, C).
    Assignments are queued in token order, so with a capacity the latest tokens are the ones dropped.
    """
    flat_experts = experts_Tk.flatten()
    order = torch.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    counts_E = torch.bincount(flat_experts, minlength=n_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slots = torch.arange(order.numel(), device=order.device) - starts_E[sorted_experts]
    if capacity is None:
        queue_len = int(counts_E.max()) if order.numel() else 0
    else:
        keep = slots < capacity
        order, sorted_experts, slots, queue_len = order[keep], sorted_experts[keep], slots[keep], capacity
    return order, sorted_experts, slots, torch.tensor(queue_len)


class MoE(nn.Module):
    """Routed experts plus optional shared experts; forward returns (output, weighted aux loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef, self.score_fn = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.router
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared_experts = None
        self.shared_gate = None
        if cfg.n_shared_experts:
            self.shared_experts = FeedForward(cfg.dim, cfg.shared_expert_ffn_dim)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)
        # Sums the routing statistics over the ranks that hold the rest of the micro-batch's tokens
        # (set by context parallel); None when this rank holds them all.
        self.token_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        n_tokens, dim = x_TD.shape
        weights_Tk, experts_Tk, scores_TE, logits_TE = self.router(x_TD)

        assignments, expert_ids, slots, queue_len = dispatch_plan(
            experts_Tk, self.n_experts, self.capacity(n_tokens)
        )
        capacity = int(queue_len)
        tokens = assignments // self.top_k
        queue_index = expert_ids * capacity + slots
        queues_ECD = x_TD.new_zeros(self.n_experts * capacity, dim).index_copy(0, queue_index, x_TD[tokens])
        out_ECD = self.experts(queues_ECD.view(self.n_experts, capacity, dim))
        gathered = out_ECD.reshape(-1, dim)[queue_index]
        weighted = gathered * weights_Tk.flatten()[assignments, None].to(gathered.dtype)
        y_TD = weighted.new_zeros(n_tokens, dim).index_add(0, tokens, weighted)

        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_TD)) * shared
            y_TD = y_TD + shared

        balance, z_loss = router_losses(
            scores_TE, experts_Tk, logits_TE, self.score_fn, self.token_sum, with_z=bool(self.z_loss_coef)
        )
        aux = self.aux_loss_coef * balance
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * z_loss
        return y_TD.view_as(x_BSD), aux
