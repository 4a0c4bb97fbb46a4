"""A run the planner says cannot fit in memory is refused before any rank allocates (`run.memory_check`).

The figure is the one `--dry-run` prints: the planner's memory of the most loaded rank for the resolved
layout (plan/estimate.py), against what one rank has: its GPU's memory as the device reports it, or on a
CPU its share of the host's RAM (the ranks on a host share it: host / ranks on it). The planner is within
10% of measured peaks (docs/planner.md, "Memory predicted against memory measured"), so only a layout
needing more than MARGIN times what there is is refused: one near the edge is left to the allocator. The
refusal lists what would fit, from the planner's search (plan/search.py): layouts on this many ranks,
else on 2, 4 or 8 times as many; `--run.memory_check=false` starts the run anyway.

Nothing is measured for the check (a dry run checks against the hardware it printed): on a CPU, the
host's RAM and this process's resident size as a rank's own (the probe's `context_bytes`); on a GPU, the
memory it reports. The rates of a CPU (placeholders) or of a GPU the planner's table lacks (an H100's)
only order the layouts listed.
"""

from __future__ import annotations

import dataclasses

from meshtron.config.schema import Config
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.layout import KEYS, Layout
from meshtron.plan.search import search
from meshtron.plan.state import expert_state_bytes
from meshtron.probe.cluster import run_cluster

MARGIN = 1.25  # refused above this many times the memory there is (the planner is within 10%)
MORE_RANKS = (2, 4, 8)  # the larger worlds searched when no layout fits on this one
LISTED = 3  # layouts named in the refusal
GiB = 2**30


def _with_ranks(cluster: Cluster, ranks: int) -> Cluster:
    """`cluster` with `ranks` ranks: GPUs of the same memory, or on a CPU ranks sharing its RAM."""
    gpu = cluster.gpu
    if gpu.name == "cpu":
        share = gpu.memory_bytes * gpu.gpus_per_node // ranks
        gpu = dataclasses.replace(gpu, memory_bytes=share, gpus_per_node=ranks)
    return dataclasses.replace(cluster, gpu=gpu, gpus=ranks)


def rank_counts(cluster: Cluster) -> list[int]:
    """The worlds searched for a layout that fits, this one first: on GPUs 2, 4 and 8 times as many
    (each brings its memory); on a CPU halving down to one (its ranks share one RAM, and each more
    holds its own activations, buffers and process)."""
    n = cluster.gpus
    if cluster.gpu.name == "cpu":
        return [n >> i for i in range(n.bit_length()) if n % (1 << i) == 0]
    return [n, *(n * f for f in MORE_RANKS)]


def too_big(cfg: Config, world_size: int, cluster: Cluster | None = None) -> str | None:
    """Why `cfg` (dp_shard resolved) cannot run on `world_size` ranks for memory, with what would fit;
    None when it fits within MARGIN, when run.memory_check is off, or when there is no cluster to ask.
    `cluster`: the hardware a dry run printed (None: run_cluster's)."""
    if not cfg.run.memory_check:
        return None
    cluster = cluster or run_cluster(cfg, world_size)
    if cluster is None:
        return None
    est = estimate(cfg, cluster)
    needed, limit = est.memory_bytes_per_gpu, cluster.gpu.memory_bytes
    if needed <= MARGIN * limit:
        return None
    gpu = cluster.gpu
    if gpu.name == "cpu":  # the ranks on a host share its RAM
        host = gpu.memory_bytes * gpu.gpus_per_node / GiB
        has = f"this host has {host:,.1f} GiB"
        if gpu.gpus_per_node > 1:
            has = f"this host's {host:,.1f} GiB over its {gpu.gpus_per_node} ranks is {limit / GiB:,.1f} GiB each"
        per = "rank"
    else:
        has, per = f"one GPU has {limit / GiB:,.1f} GiB", "GPU"
    return (
        f"this layout needs {needed / GiB:,.1f} GiB per {per} by the planner's count, and {has} "
        f"({needed / limit:.1f}x; refused above {MARGIN}x, the planner being within 10%): it would run out "
        f"of memory. {_where_it_goes(cfg, est.memory)}. {_what_fits(cfg, cluster)}. "
        "To start it anyway, set --run.memory_check=false"
    )


def _where_it_goes(cfg: Config, parts: dict[str, float]) -> str:
    """The planner's parts of the most loaded rank, largest first, and the routed experts' share of the
    parameters, gradients and optimizer state (the part expert parallel or folding shrinks)."""
    listed = ", ".join(
        f"{name} {b / GiB:,.1f}" for name, b in sorted(parts.items(), key=lambda x: -x[1]) if b
    )
    experts = max(expert_state_bytes(cfg, stage) for stage in range(cfg.parallel.pp))
    routed = ""
    if experts:
        routed = (
            f"; the routed experts' weights, gradients and optimizer state are {experts / GiB:,.1f} GiB of "
            f"them (parallel.ep={cfg.parallel.ep} spreads them; a larger ep, or ep over the tp ranks with "
            "parallel.etp=1, holds fewer per rank)"
        )
    return f"Where it goes (GiB): {listed}{routed}"


def _flags(cfg: Config, layout: Layout) -> str:
    """The overrides that turn `cfg`'s layout into `layout`: only the keys that differ."""
    flags = []
    for key in KEYS:  # each a training or a parallel key (pp_head_layers follows pp: left to the split)
        section = "training" if hasattr(cfg.training, key) else "parallel"
        value, now = getattr(layout, key), getattr(getattr(cfg, section), key)
        if value != now and key != "pp_head_layers":
            flags.append(f"--{section}.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(flags)


def _what_fits(cfg: Config, cluster: Cluster) -> str:
    """The planner's fastest layouts that fit on this many ranks, else on the first other count that
    fits (rank_counts); else the layout that comes nearest."""
    nearest: tuple[float, Layout, Cluster] | None = None  # (needed / what a rank has, layout, where)
    for ranks in rank_counts(cluster):
        where = _with_ranks(cluster, ranks)
        plan = search(cfg, where, {}, top=LISTED)
        if plan.ranked:
            nproc = "" if ranks == cluster.gpus else f"--nproc {ranks} "
            listed = "; ".join(
                f"{nproc}{_flags(cfg, layout)} ({est.memory_bytes_per_gpu / GiB:,.1f} GiB)"
                for layout, est in plan.ranked
            )
            return f"The planner's fastest layouts that fit (or let --parallel.auto=true choose): {listed}"
        if plan.least_memory is not None:
            layout, est = plan.least_memory
            ratio = est.memory_bytes_per_gpu / where.gpu.memory_bytes
            if nearest is None or ratio < nearest[0]:
                nearest = (ratio, layout, where)
    counts = rank_counts(cluster)
    tried = ", ".join(map(str, counts)) + (" rank" if counts == [1] else " ranks")
    closest = ""
    if nearest is not None:
        ratio, layout, where = nearest
        closest = f" (the nearest, {layout.describe()} on {where.gpus}, needs {ratio:.1f}x what a rank has)"
    return (
        f"No layout fits on {tried}{closest}; use a smaller model, a shorter training.seq_len, or "
        "hardware with more memory"
    )
