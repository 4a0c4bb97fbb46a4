"""The device mesh: parallel degrees -> rank coordinates, the groups of every dim, and their picture.

The world is laid out row-major over [pp, dp_replicate, dp_shard, cp, tp], so tp (the chattiest dim)
is on neighbouring ranks of one node and pp / dp_replicate span nodes. Expert parallelism borrows its
ranks from dp_shard x cp: that block is re-read as [edp, ep] with ep innermost, giving the expert
mesh [pp, dp_replicate, edp, ep, tp]; expert weights are then replicated over dp_replicate x edp.

`ParallelDims` is pure arithmetic (it draws and prints layouts without any process running);
`ParallelMesh` turns it into torch DeviceMeshes and process groups inside a running job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from meshtron.comm import CommGroup
from meshtron.config import Config, ParallelConfig
from meshtron.figures import pyplot, save_figure

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")
# Views made of several mesh dims: "dp" is the whole batch split, "dp_shard_cp" the ranks that shard
# parameters when context parallel also splits the batch's sequences.
FLAT_DIMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
)
# The first and the last stage of each pipeline, which share tied embedding weights.
PP_ENDS = "pp_ends"
# Hybrid context parallel's two parts of a cp group: all-to-all inside "cp_ulysses", a ring over "cp_ring".
CP_PARTS = ("cp_ring", "cp_ulysses")


def resolve_dp_shard(parallel: ParallelConfig, world_size: int) -> int:
    """dp_shard=-1 takes whatever the world size leaves after the other dims; otherwise it is as given."""
    if parallel.dp_shard != -1:
        return parallel.dp_shard
    others = parallel.pp * parallel.dp_replicate * parallel.cp * parallel.tp
    return max(world_size // others, 1) if others > 0 else 1


def dp_size(parallel: ParallelConfig, world_size: int) -> int:
    """The ranks that split the batch: dp_replicate x dp_shard."""
    return parallel.dp_replicate * resolve_dp_shard(parallel, world_size)


def ep_folding_problem(dp_shard: int, cp: int, ep: int) -> str | None:
    """Expert parallelism re-reads the dp_shard x cp block as [edp, ep], so ep must divide it."""
    if (dp_shard * cp) % ep == 0:
        return None
    return (
        f"parallel.ep={ep} must divide dp_shard*cp={dp_shard * cp} (experts borrow their ranks from the "
        "data- and context-parallel dims)"
    )


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """The mesh's own rules: the dims multiply to the world size, and ep folds into dp_shard x cp."""
    p = cfg.parallel
    problems = []
    others = p.pp * p.dp_replicate * p.cp * p.tp
    if p.dp_shard == -1 and world_size % others:
        problems.append(
            f"world size {world_size} is not divisible by pp*dp_replicate*cp*tp={others}; "
            f"pick degrees whose product divides {world_size}"
        )
    dp_shard = resolve_dp_shard(p, world_size)
    product = others * dp_shard
    if product != world_size:
        problems.append(
            f"pp*dp_replicate*dp_shard*cp*tp = {p.pp}*{p.dp_replicate}*{dp_shard}*{p.cp}*{p.tp} "
            f"= {product} but the world size is {world_size}; set parallel.dp_shard=-1 to absorb "
            f"the rest, or launch with --nproc {product}"
        )
    # Only for MoE models: with a dense one, ep > 1 is refused by the expert-parallel rules already.
    folding = ep_folding_problem(dp_shard, p.cp, p.ep) if cfg.model.is_moe else None
    return problems + ([folding] if folding else [])


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    # Hybrid context parallel reads each cp group as [ring, ulysses] with ulysses innermost.
    cp_ulysses: int = 1

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"parallel degrees must be positive integers, got {bad}")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"cp_ulysses={self.cp_ulysses} must divide cp={self.cp}")
        folding = ep_folding_problem(self.dp_shard, self.cp, self.ep)
        if folding:
            raise ValueError(folding)

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(
            pp=parallel.pp,
            dp_replicate=parallel.dp_replicate,
            dp_shard=resolve_dp_shard(parallel, world_size),
            cp=parallel.cp,
            tp=parallel.tp,
            ep=parallel.ep,
            cp_ulysses=parallel.cp_ulysses if parallel.cp_impl == "hybrid" else 1,
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def edp(self) -> int:
        return self.dp_shard * self.cp // self.ep

    def size(self, dim: str) -> int:
        if dim == PP_ENDS:
            return min(self.pp, 2)
        if dim in CP_PARTS:
            return self.cp_ulysses if dim == "cp_ulysses" else self.cp // self.cp_ulysses
        if dim in FLAT_DIMS:
            return int(np.prod([getattr(self, d) for d in FLAT_DIMS[dim]]))
        return getattr(self, dim)

    @cached_property
    def dense_grid(self) -> np.ndarray:
        return np.arange(self.world_size).reshape([getattr(self, d) for d in DENSE_DIMS])

    @cached_property
    def expert_grid(self) -> np.ndarray:
        return self.dense_grid.reshape(self.pp, self.dp_replicate, self.edp, self.ep, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along every dense and expert dim."""
        dense = np.argwhere(self.dense_grid == rank)[0]
        expert = np.argwhere(self.expert_grid == rank)[0]
        out = dict(zip(DENSE_DIMS, map(int, dense), strict=True))
        out.update(edp=int(expert[2]), ep=int(expert[3]))
        return out

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: lists of ranks that differ only in their `dim` coordinate(s)."""
        if dim == PP_ENDS:
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
        if dim in CP_PARTS:  # ulysses: consecutive cp ranks; ring: one of each ulysses group
            u = self.cp_ulysses
            if dim == "cp_ulysses":
                return [g[i : i + u] for g in self.groups("cp") for i in range(0, self.cp, u)]
            return [g[i::u] for g in self.groups("cp") for i in range(u)]
        if dim in DENSE_DIMS:
            grid, axes = self.dense_grid, [DENSE_DIMS.index(dim)]
        elif dim in ("ep", "edp"):
            grid, axes = self.expert_grid, [EXPERT_DIMS.index(dim)]
        elif dim in FLAT_DIMS:
            grid, axes = self.dense_grid, [DENSE_DIMS.index(d) for d in FLAT_DIMS[dim]]
        else:
            raise ValueError(
                f"unknown mesh dim {dim!r}; known: {', '.join(DENSE_DIMS + ('ep', 'edp') + tuple(FLAT_DIMS))}"
            )
        others = [a for a in range(grid.ndim) if a not in axes]
        moved = np.transpose(grid, others + axes)
        return moved.reshape(-1, int(np.prod([grid.shape[a] for a in axes]))).tolist()

    def group_table(self) -> dict[str, list[list[int]]]:
        dims = ["tp", "cp", "dp_shard", "dp_replicate", "pp", "ep", "edp"]
        if 1 < self.cp_ulysses < self.cp:  # hybrid context parallel's two parts of each cp group
            dims[2:2] = CP_PARTS
        return {dim: self.groups(dim) for dim in dims}

    def crossing_dims(self, gpus_per_node: int) -> list[str]:
        """Dims (of size > 1; the expert dims only when ep > 1) with a group spanning more than one node."""
        dims = [d for d in self.group_table() if self.size(d) > 1 and (self.ep > 1 or d not in ("ep", "edp"))]
        return [d for d in dims if any(len({r // gpus_per_node for r in g}) > 1 for g in self.groups(d))]

    def summary(self) -> str:
        dims = " x ".join(f"{d}{self.size(d)}" for d in DENSE_DIMS)
        hybrid = (
            f" (cp = ring{self.cp // self.cp_ulysses} x ulysses{self.cp_ulysses})"
            if self.cp_ulysses > 1
            else ""
        )
        return f"mesh {dims}{hybrid}" + (
            f" (ep{self.ep} x edp{self.edp} over dp_shard x cp)" if self.ep > 1 else ""
        )

    def describe(self, gpus_per_node: int) -> str:
        """Human-readable layout: dims, each rank's coordinates and node, every group of every dim."""
        sizes = ", ".join(f"{d}={self.size(d)}" for d in DENSE_DIMS + ("ep", "edp"))
        lines = [
            f"world size {self.world_size}: {sizes}; {gpus_per_node} GPUs per node, "
            f"{-(-self.world_size // gpus_per_node)} node(s)"
        ]
        lines.append("rank  node  " + "  ".join(f"{d:>12}" for d in DENSE_DIMS + ("edp", "ep")))
        for rank in range(self.world_size):
            c = self.coords(rank)
            lines.append(
                f"{rank:>4}  {rank // gpus_per_node:>4}  "
                + "  ".join(f"{c[d]:>12}" for d in DENSE_DIMS + ("edp", "ep"))
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
                "dims": {**asdict(self), "edp": self.edp, "world_size": self.world_size},
                "groups": self.group_table(),
            }
        )


def draw_mesh(dims: ParallelDims, gpus_per_node: int, out_path: str | Path) -> Path:
    """PNG with one panel per dim of size > 1: ranks laid out as nodes (rows) x GPUs (columns),
    each coloured by its group in that dim; thick lines mark node boundaries."""
    plt = pyplot()

    panels = [d for d in ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep") if dims.size(d) > 1] or ["tp"]
    n_nodes = -(-dims.world_size // gpus_per_node)
    crossing = set(dims.crossing_dims(gpus_per_node))
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    cell = 0.45 if dims.world_size <= 256 else 0.12
    fig, axes = plt.subplots(
        rows,
        cols,
        squeeze=False,
        figsize=(max(4.0, cols * (gpus_per_node * cell + 1.2)), rows * (n_nodes * cell + 1.3)),
    )
    cmap = plt.get_cmap("tab20")
    for ax, dim in zip(axes.flat, panels, strict=False):
        owner = np.full(n_nodes * gpus_per_node, -1)
        for g_id, group in enumerate(dims.groups(dim)):
            owner[group] = g_id
        colours = np.ones((n_nodes, gpus_per_node, 3))
        for rank in range(dims.world_size):
            colours[rank // gpus_per_node, rank % gpus_per_node] = cmap(owner[rank] % 20)[:3]
        ax.imshow(colours, aspect="equal")
        if dims.world_size <= 128:
            for rank in range(dims.world_size):
                ax.text(
                    rank % gpus_per_node,
                    rank // gpus_per_node,
                    str(rank),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        for boundary in range(1, n_nodes):
            ax.axhline(boundary - 0.5, color="black", linewidth=2.5)
        where = "crosses nodes" if dim in crossing else "within nodes"
        ax.set_title(f"{dim}={dims.size(dim)}: {len(dims.groups(dim))} groups, {where}", fontsize=9)
        ax.set_xticks(range(gpus_per_node) if gpus_per_node <= 16 else [])
        ax.set_yticks(range(n_nodes) if n_nodes <= 32 else [])
        ax.set_xlabel("GPU in node", fontsize=8)
        ax.set_ylabel("node", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"meshtron {dims.summary()}", fontsize=10)
    return save_figure(fig, out_path)


class ParallelMesh:
    """DeviceMeshes and process groups of a running job; every parallel piece is handed its groups here.

    The groups are those of `ParallelDims.groups`, so what `meshtron mesh` prints is what runs.
    """

    def __init__(self, dims: ParallelDims, device_type: str):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"the layout needs {dims.world_size} ranks but the job has {dist.get_world_size()}"
            )
        self.dims = dims
        self.rank = dist.get_rank()
        self.device_type = device_type
        self.world = DeviceMesh(device_type, torch.as_tensor(dims.dense_grid), mesh_dim_names=DENSE_DIMS)
        self.expert = DeviceMesh(device_type, torch.as_tensor(dims.expert_grid), mesh_dim_names=EXPERT_DIMS)
        self._flat = {name: self.world[parts]._flatten(name) for name, parts in FLAT_DIMS.items()}
        # Not a mesh dim (it skips the middle stages), so a plain process group; every rank takes part
        # in creating all of them, and a middle stage belongs to none.
        self._pp_ends = None
        if dims.pp > 2:
            self._pp_ends, _ = dist.new_subgroups_by_enumeration(dims.groups(PP_ENDS))
        self._cp_parts = {}
        if 1 < dims.cp_ulysses < dims.cp:  # hybrid context parallel's subgroups, plain groups too
            self._cp_parts = {d: dist.new_subgroups_by_enumeration(dims.groups(d))[0] for d in CP_PARTS}
        self._twins: dict[int, Any] | None = None
        self._twin_groups: list[Any] = []

    def pair_lane(self) -> dict[str, Any]:
        """A second process group for each group a chunk's forward communicates on (tp, cp and its
        parts, ep), as {name of the group: twin} (`Comm.add_pair_lane`): what a pipeline pair's forward
        uses while its backward uses the first ones. A forward on the pair lane that reaches any other
        group fails loudly instead (comm.py). Made on the first call, which every rank makes, in the same
        order; kept with the mesh and destroyed with it."""
        import torch.distributed as dist

        if self._twins is None:
            made: dict[tuple[tuple[int, ...], ...], Any] = {}
            twins = {}
            for dim in ("tp", "cp", *CP_PARTS, "ep"):
                if self.size(dim) == 1 or (dim in CP_PARTS and not self._cp_parts):
                    continue
                groups = self.dims.groups(dim)
                key = tuple(map(tuple, groups))
                if key not in made:  # dims with the same groups (cp = cp_ulysses) share a twin
                    made[key] = dist.new_subgroups_by_enumeration(groups)[0]
                    self._twin_groups.append(made[key])  # now, so close() frees it even if a later one fails
                twins[self.group(dim).process_group.group_name] = made[key]
            self._twins = twins
        return self._twins

    def close(self) -> None:
        """Destroy the process groups this mesh created (each gloo group holds threads and sockets, so a
        process that builds many meshes, such as a test worker, must release them)."""
        import torch.distributed as dist

        groups = {}
        for dim in (*DENSE_DIMS, "ep", "edp", *FLAT_DIMS):
            group = self.mesh(dim).get_group()
            groups[id(group)] = group
        for extra in [self._pp_ends, *self._cp_parts.values(), *self._twin_groups]:
            if extra is not None:
                groups[id(extra)] = extra
        for group in groups.values():
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
        self._twins, self._twin_groups = None, []

    def mesh(self, dim: str) -> Any:
        """The 1-D DeviceMesh of `dim` that contains this rank."""
        if dim in FLAT_DIMS:
            return self._flat[dim]
        return self.expert[dim] if dim in ("ep", "edp") else self.world[dim]

    def group(self, dim: str) -> CommGroup:
        """The named group of `dim` containing this rank, as the comm layer takes it."""
        if dim == PP_ENDS:
            if self.dims.pp <= 2:  # the ends are the whole pipeline
                return CommGroup(dim, tuple(self.ranks("pp")), self.mesh("pp").get_group())
            if self._pp_ends is None:
                raise ValueError(f"rank {self.rank} is on a middle pipeline stage: it has no {PP_ENDS} group")
            return CommGroup(dim, tuple(self.ranks(dim)), self._pp_ends)
        if dim in CP_PARTS:
            if not self._cp_parts:
                raise ValueError(f"{dim} exists only under hybrid context parallel (1 < cp_ulysses < cp)")
            return CommGroup(dim, tuple(self.ranks(dim)), self._cp_parts[dim])
        return CommGroup(dim, tuple(self.ranks(dim)), self.mesh(dim).get_group())

    def size(self, dim: str) -> int:
        return self.dims.size(dim)

    def with_cp(self, dim: str) -> str:
        """ "dp" or "dp_shard" joined with cp when cp > 1 (the context-parallel ranks hold the same
        parameters, so they take part in every gradient reduction): the name statistics report."""
        return f"{dim}_cp" if self.dims.cp > 1 else dim

    def local_rank(self, dim: str) -> int:
        return self.mesh(dim).get_local_rank()

    def ranks(self, dim: str) -> list[int]:
        return next(g for g in self.dims.groups(dim) if self.rank in g)

    def grid(self, rows: str, columns: str) -> list[list[int]]:
        """The ranks that share this rank's coordinates in every dense dim but `rows` and `columns`:
        `grid[i][j]` is the global rank at index i of `rows` and j of `columns`. `rows` may be a view of
        several dims (dp_shard_cp), indexed row-major as its group is."""
        row_dims = FLAT_DIMS.get(rows, (rows,))
        if columns in row_dims or not {*row_dims, columns} <= set(DENSE_DIMS):
            raise ValueError(f"grid needs two different dims of {DENSE_DIMS}, got {rows!r} and {columns!r}")
        at = self.dims.coords(self.rank)
        index = tuple(slice(None) if dim in (*row_dims, columns) else at[dim] for dim in DENSE_DIMS)
        block = self.dims.dense_grid[index]
        kept = [dim for dim in DENSE_DIMS if dim in (*row_dims, columns)]
        block = np.moveaxis(block, kept.index(columns), -1)
        return block.reshape(-1, self.dims.size(columns)).tolist()
