"""Muon's cost on a rank (training.optimizer = "muon", train/muon.py): state, Newton-Schulz, exchange.

  state          one fp32 momentum per element of a Muon matrix where AdamW keeps two moments
                 (plan/state.py), in the rows the engine owns
  Newton-Schulz  each matrix once per step, by one owner: 4·m²·n + 2·m³ FLOPs per step for m ≤ n its
                 sides, at the matmul rate of its dtype (bf16, or fp32). Owners balance the FLOPs over
                 the data-parallel group holding the pieces, then over tp for the matrices tp cuts, so
                 a rank does 1/(n·tp) of its stage's dense matrices; the routed experts of its own rows
                 (over tp too when tp cuts them)
  exchange       data parallel in row blocks: two all-to-alls (rows to the owners, results back), each
                 of this rank's rows, (n − 1)/n of them to other ranks; whole copies (DDP): one, of the
                 matrices it owns to the n − 1 others; then the same over tp for the dp owners' pieces
                 of what tp cuts. In the Newton-Schulz dtype (its input is cast to it anyway)

n is the engine's group: dp_shard x cp when it shards, else dp_replicate (HSDP's replicas each repeat
their shard group's work).
"""

from __future__ import annotations

import dataclasses

from meshtron.config.optimizer import is_muon_matrix
from meshtron.config.schema import Config
from meshtron.plan.hardware import Accelerator, peak_flops_per_s
from meshtron.plan.network import Group, LinkEfficiency, collective_time
from meshtron.plan.state import rank_parameters


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` Newton-Schulz steps on a rows x cols matrix (m <= n its sides): X Xᵀ, S·S and
    the product with X, 4·m²·n + 2·m³ per step."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(
    shapes: list[tuple[int, int]], size: int, steps: int, keys: list[str] | None = None
) -> list[int]:
    """Each matrix's owner among `size` ranks: the largest Newton-Schulz work first (equal work in the
    order of `keys`, the parameters' names, else of the list), each to the least loaded rank so far
    (ties to the lowest rank): the same on every rank, and in the planner, whatever order they come in."""
    load, owners = [0] * size, [0] * len(shapes)
    tie = keys or [f"{i:09d}" for i in range(len(shapes))]
    for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_flops(*shapes[i], steps), tie[i])):
        owner = min(range(size), key=lambda r: (load[r], r))
        owners[i], load[owner] = owner, load[owner] + newton_schulz_flops(*shapes[i], steps)
    return owners


def _logical(cfg: Config, pp_rank: int) -> dict[str, tuple[int, ...]]:
    """Stage `pp_rank`'s Muon matrices at their whole shapes (tp's cuts undone; experts: this rank's
    ep share), by name."""
    p = cfg.parallel
    whole = dataclasses.replace(cfg, parallel=dataclasses.replace(p, tp=1, sp=False, etp=0))
    return {x.name: x.shape for x in rank_parameters(whole, pp_rank) if is_muon_matrix(x.name, len(x.shape))}


def newton_schulz_work(cfg: Config, pp_rank: int = 0) -> float:
    """Newton-Schulz FLOPs per step on a rank of stage `pp_rank`: its 1/(n·tp) of the dense matrices
    (owners balance them), and the routed experts of its rows (1/tp of each where tp cuts them)."""
    p, t = cfg.parallel, cfg.training
    if t.optimizer != "muon":
        return 0.0
    steps, tp, shard = t.muon_ns_steps, p.tp, p.dp_shard * p.cp
    n = shard if shard > 1 else p.dp_replicate
    logical = list(_logical(cfg, pp_rank).values())
    flops = sum(newton_schulz_flops(*s, steps) for s in logical if len(s) == 2) / (n * tp)
    edp = p.edp_of(shard) if p.experts_apart else shard
    share = (1 / edp if edp > 1 else 1.0) / (tp if p.expert_tp else 1)
    return flops + sum(s[0] * share * newton_schulz_flops(*s[1:], steps) for s in logical if len(s) == 3)


def muon_step_time(
    cfg: Config, pp_rank: int, gpu: Accelerator, links: LinkEfficiency, matmul_share: float
) -> float:
    """Seconds of rank 0 of stage `pp_rank`'s Newton-Schulz and exchanges per step (none overlapped:
    the exchange waits for the momentum, the update for the exchange)."""
    p, t = cfg.parallel, cfg.training
    flops = newton_schulz_work(cfg, pp_rank)
    if not flops:
        return 0.0
    node, shard = gpu.gpus_per_node, p.dp_shard * p.cp
    groups = {"tp": (Group(p.tp, 1, node), 2)}
    dp = (Group(shard, p.tp, node), 2) if shard > 1 else (Group(p.dp_replicate, shard * p.tp, node), 1)
    exchange = 0.0
    for name, sent in muon_bytes(cfg, pp_rank).items():
        group, calls = groups.get(name, dp)
        buffer = sent * group.size / (group.size - 1)  # an all-to-all sends (n - 1)/n of its buffer
        exchange += collective_time("all_to_all", buffer, group, gpu, links, calls)
    rate = peak_flops_per_s(gpu, "fp32" if t.muon_ns_dtype == "fp32" else "bf16") * matmul_share
    return flops / rate + exchange


def _exchanged(
    shapes: list[tuple[int, int]], keys: list[str], n: int, split: bool, steps: int
) -> tuple[float, list[int]]:
    """(elements rank 0 sends, the owners) of one group's exchange: its block (ceil(rows / n) rows) of
    each matrix another rank owns, and the others' blocks of those it owns; whole copies: each it owns
    to the n − 1 others."""
    owners = assign_owners(shapes, n, steps, keys)
    sent = 0
    for (rows, cols), owner in zip(shapes, owners, strict=True):
        mine = min(-(-rows // n), rows) if split else rows
        if owner != 0 and split:
            sent += mine * cols
        elif owner == 0:
            sent += (rows - mine if split else rows * (n - 1)) * cols
    return sent, owners


def muon_bytes(cfg: Config, pp_rank: int = 0, dp_shard: int | None = None) -> dict[str, float]:
    """Bytes rank 0 of stage `pp_rank` sends per step in Muon's exchanges, by group name (as the
    trainer's metrics name them): the data-parallel group's, then tp's for the matrices tp cuts.
    `dp_shard`: the resolved degree, where cfg's may still be -1."""
    p, t = cfg.parallel, cfg.training
    if t.optimizer != "muon":
        return {}
    shard = (dp_shard or p.dp_shard) * p.cp
    steps, size = t.muon_ns_steps, 4 if t.muon_ns_dtype == "fp32" else 2
    n, split = (shard, True) if shard > 1 else (p.dp_replicate, False)
    cp = "_cp" if p.cp > 1 else ""
    here = {x.name: x for x in rank_parameters(cfg, pp_rank) if is_muon_matrix(x.name, len(x.shape))}
    logical = _logical(cfg, pp_rank)
    dense = [x for x in here.values() if len(x.shape) == 2]
    out: dict[str, float] = {}
    if n > 1:
        sent, owners = _exchanged([x.shape for x in dense], [x.name for x in dense], n, split, steps)
        out[f"dp_shard{cp}" if split else f"dp{cp}"] = sent * size
    else:
        owners = [0] * len(dense)
    if p.tp > 1:  # the dp owner's tp pieces of what tp cuts, and the cut experts' slices it holds
        cut = [x for x, o in zip(dense, owners, strict=True) if o == 0 and x.shape != logical[x.name]]
        pieces = [(x.name, logical[x.name]) for x in cut]
        edp = p.edp_of(shard) if p.experts_apart else shard
        for x in (x for x in here.values() if len(x.shape) == 3 and x.shape != logical[x.name]):
            held = min(-(-x.shape[0] // edp), x.shape[0]) if edp > 1 else x.shape[0]
            pieces += [(f"{x.name}[{k}]", logical[x.name][1:]) for k in range(held)]
        sent, _ = _exchanged([s for _, s in pieces], [k for k, _ in pieces], p.tp, True, steps)
        out["tp"] = sent * size
    return out
