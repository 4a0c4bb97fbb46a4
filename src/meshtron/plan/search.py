"""The search: every layout of the keys the user left open, each either refused (the reason counted)
or estimated (plan/estimate.py), ranked by step time.

  1. enumerate (plan/layout.py's table of what each key ranges over)
  2. arithmetic rules, cheap, counted by reason: the degrees multiply to the GPU count, the batch splits
     into micro-batches, tp divides the heads, pp·vpp fits the layers, interleaving's micro-batches are
     a multiple of pp, ep divides the experts and folds into dp_shard·cp
  3. estimate each survivor; one that does not fit in memory is refused ("memory"): the screen's
     closed-form bound first, and where that says no, the schedule's own walk (the bound counts every
     chunk in flight as the largest, the head's logits on it, so it can refuse what fits)
  4. rank by step time; walk down the ranking through the trainer's own rules (checks.validate and
     what this version cannot run yet) until `top` layouts pass: what is listed, meshtron runs

A model that fits nowhere gets the layout that needs the least memory, to say what is short.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from meshtron.config.layout import divisors
from meshtron.config.schema import Config
from meshtron.plan.estimate import Cluster, Estimate, estimate, least_memory, stage_memories
from meshtron.plan.flops import head_layers
from meshtron.plan.layout import Layout
from meshtron.plan.network import Group
from meshtron.rules.checks import not_yet_supported, validate
from meshtron.rules.data import micro_batches_per_step

MICRO_BATCHES = (1, 2, 4, 8)
# Less recompute first: a layout is not tried again with more once it fits. "op" keeps less than
# "selective" and reruns less (the elementwise work; selective reruns the attention core).
RECOMPUTE = ("none", "op", "selective", "full")


@dataclass
class Plan:
    """The ranked layouts that fit and pass the trainer's rules, and why the others were dropped."""

    ranked: list[tuple[Layout, Estimate]]
    refused: Counter = field(default_factory=Counter)  # reason -> candidates
    examined: int = 0
    least_memory: tuple[Layout, Estimate] | None = None  # when none fits in memory: the least needing


def _options(fixed: dict[str, Any], key: str, default: Any) -> list[Any]:
    return [fixed[key]] if key in fixed else list(default)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _dp_splits(fixed: dict[str, Any], dp: int, tp_cp: int, per_node: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero): DDP, ZeRO-1/2/3 over all of dp, and HSDP whose shard spans 1, 2
    or 4 nodes; or the user's split with each ZeRO stage."""
    if "dp_replicate" in fixed or "dp_shard" in fixed:
        replicate = fixed.get("dp_replicate") or max(1, dp // fixed["dp_shard"])
        shard = fixed.get("dp_shard") or max(1, dp // replicate)
        return [
            (replicate, shard, zero) for zero in _options(fixed, "zero", (1, 2, 3) if shard > 1 else (1,))
        ]
    splits = [(dp, 1, 1)] + [(1, dp, zero) for zero in (1, 2, 3) if dp > 1]
    for nodes in (1, 2, 4):
        shard = nodes * per_node // tp_cp
        if 1 < shard < dp and dp % shard == 0:
            splits.append((dp // shard, shard, 3))
    return [s for s in dict.fromkeys(splits) if "zero" not in fixed or s[2] == fixed["zero"] or s[1] == 1]


def candidates(cfg: Config, gpus: int, per_node: int, fixed: dict[str, Any]) -> Iterator[Layout | str]:
    """Every layout of the open keys, or the reason a combination breaks an arithmetic rule."""
    m, t = cfg.model, cfg.training
    tps = _options(fixed, "tp", [d for d in _powers_of_two(per_node) if gpus % d == 0])
    cps = _options(
        fixed, "cp", [c for c in _powers_of_two(max(1, t.seq_len // 4096)) if t.seq_len % (2 * c) == 0]
    )
    for tp, cp in itertools.product(tps, cps):
        if m.n_heads % tp:
            yield "tp must divide model.n_heads"
            continue
        impls = _options(fixed, "cp_impl", ("ring", "alltoall") if cp > 1 else ("ring",))
        for pp in _options(fixed, "pp", [d for d in divisors(max(1, gpus // (tp * cp))) if d <= m.n_layers]):
            if gpus % (tp * cp * pp):
                yield "tp*cp*pp must divide the GPU count"
                continue
            dp = gpus // (tp * cp * pp)
            for (rep, shard, zero), (schedule, vpp), impl in itertools.product(
                _dp_splits(fixed, dp, tp * cp, per_node), _schedules(fixed, pp), impls
            ):
                base = Layout(
                    pp=pp,
                    dp_replicate=rep,
                    dp_shard=shard,
                    cp=cp,
                    tp=tp,
                    vpp=vpp,
                    zero=zero,
                    pp_schedule=schedule,
                    cp_impl=impl,
                    sp=tp > 1,
                )
                yield from _finish(cfg, gpus, per_node, fixed, base)


def _schedules(fixed: dict[str, Any], pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [(fixed.get("pp_schedule", "1f1b"), fixed.get("vpp", 1))]
    if "pp_schedule" in fixed or "vpp" in fixed:
        schedule = fixed.get("pp_schedule", "interleaved" if fixed.get("vpp", 1) > 1 else "1f1b")
        return [(schedule, fixed.get("vpp", 2 if schedule == "interleaved" else 1))]
    return [("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("interleaved", 4)]


def _dispatches(cfg: Config, fixed: dict[str, Any], ep: int, etp: int, per_node: int) -> list[str]:
    """The expert dispatches to try: the held one (--layout, or a config's other than the default), else
    the all-to-all and, where the ep group crosses nodes in whole nodes, DeepEP's two hops."""
    if "ep_dispatch" in fixed or cfg.parallel.ep_dispatch != "alltoall" or ep == 1:
        return [fixed.get("ep_dispatch", cfg.parallel.ep_dispatch)]
    group = Group(ep, etp, per_node)  # the experts' grid puts ep's neighbours etp ranks apart
    whole_nodes = group.crosses_nodes and ep % group.per_node == 0
    return ["alltoall", "hierarchical"] if whole_nodes else ["alltoall"]


def _finish(
    cfg: Config, gpus: int, per_node: int, fixed: dict[str, Any], base: Layout
) -> Iterator[Layout | str]:
    """The micro-batch, recompute, ep, its dispatch and sp choices of one mesh, with their arithmetic
    rules."""
    m, t = cfg.model, cfg.training
    head = head_layers(m, t.seq_len) if base.pp > 1 else 0.0
    if base.world_size != gpus:
        yield "the degrees must multiply to the GPU count"
        return
    if base.pp * base.vpp > m.n_layers:
        yield "pp*vpp must not exceed model.n_layers"
        return
    # The experts' grid: split over tp (etp = tp, ep over dp_shard x cp) or whole (etp = 1, ep over the
    # stage's ranks, tp's included: MoE parallel folding).
    etps = _options(fixed, "etp", list(dict.fromkeys((base.tp, 1))) if m.is_moe else [base.tp])
    etps = [etp or base.tp for etp in etps]  # a held etp of 0 is the config's "= tp"
    experts = [
        (etp, ep) for etp in etps for ep in _options(fixed, "ep", divisors(m.n_experts) if m.is_moe else [1])
    ]
    # In this order the search can skip what cannot win: a larger micro-batch than one that does not
    # fit, and more recompute than a mode that fits (the same layout, only more compute).
    for (etp, ep), micro_batch, recompute in itertools.product(
        experts, _options(fixed, "micro_batch", MICRO_BATCHES), _options(fixed, "recompute", RECOMPUTE)
    ):
        if t.global_batch % (micro_batch * base.dp):
            yield "training.global_batch must be a multiple of micro_batch*dp"
            continue
        micro = micro_batches_per_step(t.global_batch, micro_batch, base.dp)
        if base.pp > 1 and micro < base.pp:
            yield "micro-batches per step must be at least pp"
            continue
        if base.pp_schedule == "interleaved" and micro % base.pp:
            yield "interleaved needs micro-batches per step a multiple of pp"
            continue
        block = base.dp_shard * base.cp * (base.tp if etp == 1 else 1)
        if etp not in (1, base.tp):
            yield "etp must be 1 (whole experts) or tp (each expert cut as the dense layers are)"
            continue
        if ep > 1 and (m.n_experts % ep or block % ep):
            yield "ep must divide model.n_experts and dp_shard*cp (dp_shard*cp*tp with etp=1)"
            continue
        chosen = dict(
            micro_batch=micro_batch, recompute=recompute, ep=ep, etp=etp, sp=fixed.get("sp", base.tp > 1)
        )
        # The head counted as its FLOPs in layers, so the split does not make the last stage the slowest.
        chosen["pp_head_layers"] = fixed.get("pp_head_layers", head)
        for dispatch in _dispatches(cfg, fixed, ep, etp, per_node):
            yield dataclasses.replace(base, **chosen, ep_dispatch=dispatch)


def _walked_bytes(cfg: Config, cluster: Cluster) -> float:
    """The most loaded stage's bytes with the activations its schedule holds at most, walked action by
    action: what `estimate` reports, without the timing."""
    return max(sum(stage.values()) for stage in stage_memories(cfg, cluster))


def _trainer_problem(cfg: Config, gpus: int) -> str | None:
    """The first rule of the trainer's a layout breaks, with numbers masked so that reasons count."""
    problems = validate(cfg, gpus) or not_yet_supported(cfg, gpus)
    return re.sub(r"\d+", "N", problems[0]) if problems else None


SCREENED = 4  # the screen's best top·SCREENED layouts get the simulator's pipeline before ranking


def _simulated(
    cfg: Config,
    cluster: Cluster,
    screened: list[tuple[Layout, Estimate]],
    top: int,
    plan: Plan,
    imbalance: float,
):
    """The best screened layouts that pass the trainer's rules, timed again with the simulator, ranked.
    When every one of them is over memory, the least needing becomes the plan's `least_memory`."""
    out: list[tuple[Layout, Estimate]] = []
    over: list[tuple[Layout, Estimate]] = []
    for layout, _ in screened:
        if len(out) == top * SCREENED:
            break
        problem = _trainer_problem(layout.apply(cfg), cluster.gpus)
        if problem:
            plan.refused[f"trainer rule: {problem}"] += 1
            continue
        result = estimate(layout.apply(cfg), cluster, imbalance=imbalance)
        if not result.fits:  # the simulator's in-flight count can exceed the screen's
            plan.refused["memory: needs more than the GPU has"] += 1
            over.append((layout, result))
            continue
        out.append((layout, result))
    if over and not out and not any(reason.startswith("trainer rule") for reason in plan.refused):
        plan.least_memory = min(over, key=lambda ranked: ranked[1].memory_bytes_per_gpu)
    out.sort(key=rank_key)
    return out[:top]


def rank_key(ranked: tuple[Layout, Estimate]) -> tuple[float, float, float]:
    """The ranking: step time to 4 figures (closer is within the model's noise), then less memory,
    then the step time unrounded."""
    est = ranked[1]
    return float(f"{est.step_time_s:.4g}"), est.memory_bytes_per_gpu, est.step_time_s


def search(
    cfg: Config, cluster: Cluster, fixed: dict[str, Any], top: int = 5, imbalance: float = 1.0
) -> Plan:
    """The `top` fastest layouts of `cfg`'s model and batch on `cluster` with `fixed` keys held;
    `imbalance` is an MoE router's expected busiest-over-mean expert load (estimate's)."""
    plan = Plan(ranked=[])
    fitting: list[tuple[float, Layout, Estimate]] = []
    fits: set[Layout] = set()  # layouts (recompute blanked) that fit with some recompute mode
    too_big: set[Layout] = set()  # layouts (micro-batch blanked) that did not fit at a smaller one
    smallest: tuple[float, Layout] | None = None
    for item in candidates(cfg, cluster.gpus, cluster.gpu.gpus_per_node, fixed):
        plan.examined += 1
        if isinstance(item, str):
            plan.refused[item] += 1
            continue
        any_recompute = dataclasses.replace(item, recompute="")
        any_micro_batch = dataclasses.replace(item, micro_batch=0)
        if any_recompute in fits:
            plan.refused["slower: the same layout fits with less recompute"] += 1
            continue
        candidate = item.apply(cfg)
        bound = -1.0 if any_micro_batch in too_big else least_memory(candidate, cluster)
        if bound > cluster.gpu.memory_bytes or any_micro_batch in too_big:
            too_big.add(any_micro_batch)
            plan.refused["memory: needs more than the GPU has"] += 1
            if bound > 0 and (smallest is None or bound < smallest[0]):  # a lower bound: walk it
                walked = _walked_bytes(candidate, cluster)
                smallest = (walked, item) if smallest is None or walked < smallest[0] else smallest
            continue
        result = estimate(candidate, cluster, simulated=False, imbalance=imbalance)
        walked = result.memory_bytes_per_gpu if result.fits else _walked_bytes(candidate, cluster)
        if walked > cluster.gpu.memory_bytes:
            too_big.add(any_micro_batch)
            plan.refused["memory: needs more than the GPU has"] += 1
            if smallest is None or walked < smallest[0]:
                smallest = (walked, item)
            continue
        fits.add(any_recompute)
        fitting.append((result.step_time_s, item, result))
    fitting.sort(key=lambda x: (x[0], x[2].memory_bytes_per_gpu))
    screened = [(layout, result) for _, layout, result in fitting]
    plan.ranked = _simulated(cfg, cluster, screened, top, plan, imbalance)
    if not fitting and smallest is not None:  # memory is what is short (not a trainer rule)
        plan.least_memory = (smallest[1], estimate(smallest[1].apply(cfg), cluster, imbalance=imbalance))
    return plan
