"""The layout core: parallel degrees -> world size, every rank's coordinates, the groups of every dim,
and the problems of the degrees themselves. Pure arithmetic (numpy, no torch): config, the device mesh, the planner and
`meshtron mesh` all read degrees from here.

The world is laid out row-major over [pp, dp_replicate, dp_shard, cp, tp], so tp (the chattiest dim)
is on neighbouring ranks of one node and pp / dp_replicate span nodes. The experts have a grid of their
own over the same ranks (MoE parallel folding, Liu et al. 2025, as Megatron-Core has it): each stage's
dp_shard x cp x tp block is re-read as [edp, ep, etp] with etp innermost, giving the expert mesh
[pp, dp_replicate, edp, ep, etp]. etp = tp splits every expert over the tp ranks, so ep takes its ranks
from dp_shard x cp; etp = 1 keeps experts whole, so ep may take tp ranks too (tp 2 x dp 16 for
attention, ep 32 for the experts). Expert weights are replicated over dp_replicate x edp.

  degree        what it is                                         resolved how
  world size    pp · dp_replicate · dp_shard · cp · tp             -
  dp_shard      sharded data parallel                              -1: the world size over the others
  dp            dp_replicate · dp_shard (the ranks splitting the batch)
  etp           expert tensor parallel                             tp (0 or tp) or 1
  ep, edp       ep · etp · edp = dp_shard · cp · tp                ep · etp must divide dp_shard · cp · tp
  cp_ulysses    hybrid cp: all-to-all ranks inside each ring rank  divides cp (1 unless cp_impl = hybrid)

`mesh.ParallelMesh` turns a `ParallelDims` into torch DeviceMeshes and process groups inside a job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import Enum
from functools import cached_property
from types import MappingProxyType

import numpy as np

from meshtron.utils.words import plural


class Dim(str, Enum):
    """A mesh axis, or a view over several; its value is the name that groups, metrics and configs use
    (a Dim equals, hashes and formats as that string)."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EDP = "edp"  # the experts' data-parallel ranks: dp_shard x cp x tp re-read as [edp, ep, etp]
    EP = "ep"
    ETP = "etp"  # the experts' tensor-parallel ranks: the tp ranks (etp = tp), or each rank alone
    DP = "dp"  # the whole batch split: dp_replicate x dp_shard
    DP_SHARD_CP = "dp_shard_cp"  # the ranks that shard parameters when cp also splits the sequences
    DP_CP = "dp_cp"  # every rank holding a different part of the batch
    PP_ENDS = "pp_ends"  # the first and the last stage of each pipeline (tied embedding weights)
    CP_RING = "cp_ring"  # hybrid context parallel: the ring over the all-to-all groups
    CP_ULYSSES = "cp_ulysses"  # hybrid context parallel: the all-to-all inside consecutive cp ranks

    __str__ = str.__str__  # "tp", not "Dim.TP", in messages and f-strings on every Python
    __format__ = str.__format__


DENSE_DIMS = (Dim.PP, Dim.DP_REPLICATE, Dim.DP_SHARD, Dim.CP, Dim.TP)
EXPERT_DIMS = (Dim.PP, Dim.DP_REPLICATE, Dim.EDP, Dim.EP, Dim.ETP)
# Views made of several mesh dims.
FLAT_DIMS: Mapping[Dim, tuple[Dim, ...]] = MappingProxyType(
    {
        Dim.DP: (Dim.DP_REPLICATE, Dim.DP_SHARD),
        Dim.DP_SHARD_CP: (Dim.DP_SHARD, Dim.CP),
        Dim.DP_CP: (Dim.DP_REPLICATE, Dim.DP_SHARD, Dim.CP),
    }
)
PP_ENDS = Dim.PP_ENDS
CP_PARTS = (Dim.CP_RING, Dim.CP_ULYSSES)


def ep_folding_problem(dp_shard: int, cp: int, tp: int, ep: int, etp: int) -> str | None:
    """The experts' grid re-reads each stage's dp_shard x cp x tp block as [edp, ep, etp]: etp is tp
    (ep then divides dp_shard x cp) or 1 (ep divides the whole block)."""
    if etp not in (1, tp):
        return f"parallel.etp={etp} must be 1 (whole experts) or tp={tp} (experts split like the FFN)"
    if etp == tp and (dp_shard * cp) % ep:
        return (
            f"parallel.ep={ep} must divide dp_shard*cp={dp_shard * cp} when experts are split over tp "
            f"(etp=tp); with parallel.etp=1 ep may take tp ranks too (ep dividing dp_shard*cp*tp="
            f"{dp_shard * cp * tp})"
        )
    if (dp_shard * cp * tp) % ep:
        return f"parallel.ep={ep} must divide dp_shard*cp*tp={dp_shard * cp * tp} (the ranks of a stage)"
    return None


def absorbed_dp_shard(dp_shard: int, others: int, world_size: int) -> int:
    """dp_shard=-1 takes whatever the world size leaves after the other dims (`others`, their product);
    otherwise it is as given. Lenient (never raises), for rules that run before the layout is known valid."""
    if dp_shard != -1:
        return dp_shard
    return max(world_size // others, 1) if others > 0 else 1


def world_size_problems(degrees: Mapping[str, int], dp_shard: int, world_size: int) -> list[str]:
    """The dims must multiply to the world size: at most one problem, with fixes that work. `degrees`:
    pp, dp_replicate, cp, tp (dp_shard apart: -1 absorbs what they leave)."""
    others = int(np.prod(list(degrees.values())))
    named = {**degrees, "dp_shard": dp_shard} if dp_shard != -1 else dict(degrees)
    product = others * max(dp_shard, 1)
    shown = " * ".join(f"{d}={v}" for d, v in named.items() if v > 1) or "1"
    shown += f" = {product}" if "*" in shown else ""
    if dp_shard == -1 and world_size % others == 0:
        return []
    if dp_shard != -1 and product == world_size:
        return []
    if dp_shard == -1:  # any multiple of the other dims works
        ranks = [n for n in (others * (world_size // others), others * (world_size // others + 1)) if n]
        fits = [f"{d} in {divisors(world_size)}" for d, v in degrees.items() if v > 1 and world_size % v]
        fix = " or ".join(f"--nproc {n}" for n in ranks) + (f", or use {', '.join(fits)}" if fits else "")
        return [
            f"the world size {world_size} is not divisible by {shown} (dp_shard takes the rest); launch {fix}"
        ]
    fix = f"launch --nproc {product}"
    if world_size % others == 0:
        fix += f", or set parallel.dp_shard={world_size // others} (or -1, which takes the rest)"
    return [f"the dims multiply to {shown} but the world size is {world_size}; {fix}"]


def divisors(n: int) -> list[int]:
    """What a "use X in [...]" fix offers."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    # Expert tensor parallel: 0 (= tp) or tp splits every expert like the FFN; 1 keeps experts whole.
    etp: int = 0
    # Hybrid context parallel reads each cp group as [ring, ulysses] with ulysses innermost.
    cp_ulysses: int = 1

    def __post_init__(self) -> None:
        degrees = {f.name: getattr(self, f.name) for f in fields(ParallelDims) if f.name != "etp"}
        bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"parallel degrees must be positive integers, got {bad}")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"cp_ulysses={self.cp_ulysses} must divide cp={self.cp}")
        folding = ep_folding_problem(self.dp_shard, self.cp, self.tp, self.ep, self.expert_tp)
        if folding:
            raise ValueError(folding)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The ranks that split the batch: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_tp(self) -> int:
        """The etp degree: tp (etp 0 or tp) or 1."""
        return self.tp if self.etp in (0, self.tp) else self.etp

    @property
    def experts_apart(self) -> bool:
        """Whether the experts have a grid of their own (ep > 1, or whole experts over the tp ranks), so
        their own engine reduces and shards them over edp."""
        return self.ep > 1 or self.expert_tp < self.tp

    @property
    def edp(self) -> int:
        return self.dp_shard * self.cp * self.tp // (self.ep * self.expert_tp)

    def size(self, dim: str) -> int:
        if dim == PP_ENDS:
            return min(self.pp, 2)
        if dim == Dim.ETP:
            return self.expert_tp
        if dim in CP_PARTS:
            return self.cp_ulysses if dim == Dim.CP_ULYSSES else self.cp // self.cp_ulysses
        if dim in FLAT_DIMS:
            return int(np.prod([getattr(self, d) for d in FLAT_DIMS[dim]]))
        return getattr(self, dim)

    @cached_property
    def dense_grid(self) -> np.ndarray:
        return np.arange(self.world_size).reshape([getattr(self, d) for d in DENSE_DIMS])

    @cached_property
    def expert_grid(self) -> np.ndarray:
        return self.dense_grid.reshape(self.pp, self.dp_replicate, self.edp, self.ep, self.expert_tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along every dense and expert dim."""
        dense = np.argwhere(self.dense_grid == rank)[0]
        expert = np.argwhere(self.expert_grid == rank)[0]
        out = dict(zip(DENSE_DIMS, map(int, dense), strict=True))
        out.update(edp=int(expert[2]), ep=int(expert[3]), etp=int(expert[4]))
        return out

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: lists of ranks that differ only in their `dim` coordinate(s)."""
        if dim == PP_ENDS:
            return [sorted({g[0], g[-1]}) for g in self.groups(Dim.PP)]
        if dim in CP_PARTS:  # ulysses: consecutive cp ranks; ring: one of each ulysses group
            u = self.cp_ulysses
            if dim == Dim.CP_ULYSSES:
                return [g[i : i + u] for g in self.groups(Dim.CP) for i in range(0, self.cp, u)]
            return [g[i::u] for g in self.groups(Dim.CP) for i in range(u)]
        if dim in DENSE_DIMS:
            grid, axes = self.dense_grid, [DENSE_DIMS.index(dim)]
        elif dim in (Dim.EP, Dim.EDP, Dim.ETP):
            grid, axes = self.expert_grid, [EXPERT_DIMS.index(dim)]
        elif dim in FLAT_DIMS:
            grid, axes = self.dense_grid, [DENSE_DIMS.index(d) for d in FLAT_DIMS[dim]]
        else:
            raise ValueError(
                f"unknown mesh dim {dim!r}; known: {', '.join(DENSE_DIMS + ('ep', 'edp', 'etp') + tuple(FLAT_DIMS))}"
            )
        others = [a for a in range(grid.ndim) if a not in axes]
        moved = np.transpose(grid, others + axes)
        return moved.reshape(-1, int(np.prod([grid.shape[a] for a in axes]))).tolist()

    def group_table(self) -> dict[str, list[list[int]]]:
        dims = [Dim.TP, Dim.CP, Dim.DP_SHARD, Dim.DP_REPLICATE, Dim.PP, Dim.EP, Dim.EDP]
        if 1 < self.cp_ulysses < self.cp:  # hybrid context parallel's two parts of each cp group
            dims[2:2] = CP_PARTS
        return {dim: self.groups(dim) for dim in dims}

    def ep_node_groups(self, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
        """The ep groups cut by node, for the two-hop dispatch (parallel/expert.py NodeDispatch): (the ranks
        of each ep group on one node, in ep order; the ranks of each ep group at the same index on every
        node, in node order). Rank r is on node r // ranks_per_node; every ep group must hold the same
        number of ranks on each of its nodes, consecutive in ep order (ValueError says what to change)."""
        intra, inter = [], []
        for group in self.groups(Dim.EP):
            nodes = [r // ranks_per_node for r in group]
            per_node = nodes.count(nodes[0])
            blocks = [group[i : i + per_node] for i in range(0, len(group), per_node)]
            cut = all(len(b) == per_node and len({r // ranks_per_node for r in b}) == 1 for b in blocks)
            if not cut or len(set(nodes)) != len(blocks):
                raise ValueError(
                    f"ep group {group} is not cut into equal blocks of consecutive ranks by nodes of "
                    f"{ranks_per_node} ranks; the hierarchical dispatch needs ep = (ep ranks per node) x (nodes)"
                )
            intra += blocks
            inter += [list(column) for column in zip(*blocks, strict=True)]
        return intra, inter

    def crossing_dims(self, gpus_per_node: int) -> list[str]:
        """Dims (of size > 1; the expert dims only when ep > 1) with a group spanning more than one node."""
        dims = [
            d for d in self.group_table() if self.size(d) > 1 and (self.ep > 1 or d not in (Dim.EP, Dim.EDP))
        ]
        return [d for d in dims if any(len({r // gpus_per_node for r in g}) > 1 for g in self.groups(d))]

    def summary(self) -> str:
        dims = " x ".join(f"{d}{self.size(d)}" for d in DENSE_DIMS)
        hybrid = (
            f" (cp = ring{self.cp // self.cp_ulysses} x ulysses{self.cp_ulysses})"
            if self.cp_ulysses > 1
            else ""
        )
        over = "dp_shard x cp" if self.expert_tp == self.tp else "dp_shard x cp x tp"
        experts = f" (ep{self.ep} x edp{self.edp} over {over})" if self.ep > 1 else ""
        if self.expert_tp == 1 < self.tp:
            experts = f" (experts: ep{self.ep} x edp{self.edp} over dp_shard x cp x tp, etp1)"
        return f"mesh {dims}{hybrid}{experts}"

    def describe(self, gpus_per_node: int, unit: str = "GPU") -> str:
        """Human-readable layout: dims, each rank's coordinates and node, every group of every dim;
        `unit` names what a rank runs on ("GPU", or "rank" for CPU processes)."""
        sizes = ", ".join(f"{d}={self.size(d)}" for d in (*DENSE_DIMS, Dim.EP, Dim.EDP))
        lines = [
            f"world size {self.world_size}: {sizes}; {plural(gpus_per_node, unit)} per node, "
            f"{plural(-(-self.world_size // gpus_per_node), 'node')}"
        ]
        lines.append("rank  node  " + "  ".join(f"{d:>12}" for d in (*DENSE_DIMS, Dim.EDP, Dim.EP)))
        for rank in range(self.world_size):
            c = self.coords(rank)
            lines.append(
                f"{rank:>4}  {rank // gpus_per_node:>4}  "
                + "  ".join(f"{c[d]:>12}" for d in (*DENSE_DIMS, Dim.EDP, Dim.EP))
            )
        for dim, groups in self.group_table().items():
            lines.append(f"{dim} groups (size {self.size(dim)}): " + " ".join(str(g) for g in groups))
        crossing = self.crossing_dims(gpus_per_node)
        lines.append(
            "dims crossing nodes: " + (", ".join(crossing) if crossing else "none (all within a node)")
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "dims": {
                    **asdict(self),
                    "etp": self.expert_tp,
                    "edp": self.edp,
                    "world_size": self.world_size,
                },
                "groups": self.group_table(),
            }
        )
