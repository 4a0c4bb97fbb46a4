"""Where a token's experts live, in expectation: how many ep ranks one token is sent to by the `dedup`
dispatch (parallel/expert.py), which sends a token once to each rank holding one or more of its experts.

With routing spread evenly (every expert equally likely, a token's k experts distinct) and each rank
holding a block of r consecutive experts, rank j receives the token unless none of its k choices falls in
j's block. Without groups the k choices are a uniform k-subset of the E experts:

  P(miss) = C(E − r, k) / C(E, k)

Under DeepSeek-V3's group-limited routing (G groups of E/G consecutive experts, a token's experts all
from its best g groups: DeepSeek-AI 2024, §2.1.2 "node-limited routing") take the g groups as a uniform
g-subset of the G and the k experts as a uniform k-subset of their M = g·E/G experts. A block then covers
b = max(1, r·G/E) groups, e = min(r, E/G) experts in each; with j of its groups among the token's
(hypergeometric):

  P(miss) = Σ_j  C(b, j)·C(G − b, g − j) / C(G, g)  ·  C(M − j·e, k) / C(M, k)

and a token reaches ep·(1 − P(miss)) ranks, at most min(k, ep) and, when the groups are the ranks
(G = ep), at most g. Measured routing is what a trained router gives; this is the planner's prior.
"""

from __future__ import annotations

from math import comb

from meshtron.config.schema import ModelConfig


def miss_probability(cfg: ModelConfig, block: int) -> float:
    """P(none of a token's top_k experts is in one rank's block of `block` consecutive experts)."""
    E, k = cfg.n_experts, cfg.top_k
    groups, best = (cfg.n_expert_groups, cfg.topk_expert_groups) if cfg.n_expert_groups > 1 else (1, 1)
    per_group = E // groups
    covered, each = max(1, block * groups // E), min(block, per_group)
    choices = best * per_group
    return sum(
        comb(covered, j)
        * comb(groups - covered, best - j)
        / comb(groups, best)
        * comb(choices - j * each, k)
        / comb(choices, k)
        for j in range(min(covered, best) + 1)
    )


def ranks_per_token(cfg: ModelConfig, ep: int) -> float:
    """Expected ep ranks (this one included) a token is sent to by the dedup dispatch, each rank of the
    ep group holding E/ep experts."""
    return ep * (1.0 - miss_probability(cfg, cfg.n_experts // ep))


def hierarchical_rows(
    cfg: ModelConfig, ep: int, per_node: int, tokens: float
) -> list[tuple[str, float, int, int]]:
    """The hierarchical dispatch's two exchanges for `tokens` tokens per rank, each as (group, rows each
    way including those a rank keeps, experts per member, members): over the network one row per token
    and node holding its experts (each node a block of per_node·E/ep experts); inside a node one per
    arrived row and rank holding its experts, which by symmetry totals a token's ranks over the ep group."""
    nodes, local = ep // per_node, cfg.n_experts // ep
    return [
        ("ep_inter", tokens * ranks_per_token(cfg, nodes), per_node * local, nodes),
        ("ep_intra", tokens * ranks_per_token(cfg, ep), local, per_node),
    ]
