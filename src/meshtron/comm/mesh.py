"""The device mesh of a running job: a layout's degrees (layout.ParallelDims) as torch DeviceMeshes and
process groups, one named group per dim for this rank.

Dense mesh [pp, dp_replicate, dp_shard, cp, tp] and expert mesh [pp, dp_replicate, edp, ep, etp] over the
same ranks, the flattened views (dp, dp_shard_cp, dp_cp), the first and last pipeline stages (pp_ends,
for tied embeddings), hybrid context parallel's two parts, and the pair lane's twin groups. Every
parallel piece is handed its groups from here; no module keeps a process group of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.comm.group import CommGroup
from meshtron.config.layout import CP_PARTS, DENSE_DIMS, EXPERT_DIMS, FLAT_DIMS, PP_ENDS, Dim, ParallelDims


class ParallelMesh:
    """DeviceMeshes and process groups of a running job; every parallel piece is handed its groups here.

    The groups are those of `ParallelDims.groups`, so what `meshtron mesh` prints is what runs.
    """

    def __init__(self, dims: ParallelDims, device_type: str):
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"the layout needs {dims.world_size} ranks but the job has {dist.get_world_size()}"
            )
        self.dims = dims
        self.rank = dist.get_rank()
        self.device_type = device_type
        self.world = DeviceMesh(
            device_type, torch.as_tensor(dims.dense_grid), mesh_dim_names=tuple(map(str, DENSE_DIMS))
        )
        self.expert = DeviceMesh(
            device_type, torch.as_tensor(dims.expert_grid), mesh_dim_names=tuple(map(str, EXPERT_DIMS))
        )
        self._flat = {name: self.world[parts]._flatten(str(name)) for name, parts in FLAT_DIMS.items()}
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
        self._checkpoint_group: Any = None
        self._ep_nodes: tuple[CommGroup, CommGroup] | None = None
        self._ep_node_cut: tuple[list[list[int]], list[list[int]]] = ([], [])  # their ranks, for twins
        self._sliced: dict[str, Any] = {}  # 1-D meshes by dim: slicing a DeviceMesh builds a new one
        self._closed = False

    def pair_lane(self) -> dict[str, Any]:
        """A second process group for each group a chunk's forward communicates on (tp, cp and its
        parts, ep, and the ep group's node cut when the hierarchical dispatch made one), as {name of the
        group: twin} (`Comm.add_pair_lane`): what a pipeline pair's forward uses while its backward uses
        the first ones. A forward on the pair lane that reaches any other
        group fails loudly instead (collectives.py). Made on the first call, which every rank makes, in the same
        order; kept with the mesh and destroyed with it."""

        if self._twins is None:
            made: dict[tuple[tuple[int, ...], ...], Any] = {}
            twins = {}
            for dim in (Dim.TP, Dim.CP, *CP_PARTS, Dim.EP):
                if self.size(dim) == 1 or (dim in CP_PARTS and not self._cp_parts):
                    continue
                groups = self.dims.groups(dim)
                key = tuple(map(tuple, groups))
                if key not in made:  # dims with the same groups (cp = cp_ulysses) share a twin
                    made[key] = dist.new_subgroups_by_enumeration(groups)[0]
                    self._twin_groups.append(made[key])  # now, so close() frees it even if a later one fails
                twins[self.group(dim).process_group.group_name] = made[key]
            for part, groups in zip(self._ep_nodes or (), self._ep_node_cut, strict=False):
                twin = dist.new_subgroups_by_enumeration(groups)[0]
                self._twin_groups.append(twin)
                twins[part.process_group.group_name] = twin
            self._twins = twins
        return self._twins

    def ep_node_groups(self, ranks_per_node: int) -> tuple[CommGroup, CommGroup]:
        """This rank's ep group cut by node (ParallelDims.ep_node_groups): ("ep_intra", its ep ranks on this
        node; "ep_inter", the ep ranks at its index on every node). Made on the first call, which every
        rank makes; destroyed with the mesh."""
        if self._ep_nodes is None:
            parts = []
            self._ep_node_cut = self.dims.ep_node_groups(ranks_per_node)
            for name, groups in zip(("ep_intra", "ep_inter"), self._ep_node_cut, strict=True):
                group, _ = dist.new_subgroups_by_enumeration(groups)
                ranks = next(g for g in groups if self.rank in g)
                parts.append(CommGroup(name, tuple(ranks), group))
            self._ep_nodes = (parts[0], parts[1])
        return self._ep_nodes

    def checkpoint_group(self) -> CommGroup:
        """Every rank on a gloo group of its own, for asynchronous checkpoints: DCP writes in a background
        thread whose collectives must not share a group with the training step's (and need a CPU
        backend under NCCL). Made on the first call, which every rank makes; destroyed with the mesh."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return CommGroup("checkpoint", tuple(range(dist.get_world_size())), self._checkpoint_group)

    def close(self) -> None:
        """Destroy the process groups this mesh created (each gloo group holds threads and sockets, so a
        process that builds many meshes, such as a test worker, must release them). A second call does
        nothing. The groups' threads end when the last reference goes: a DeviceMesh and its flattened
        views form reference cycles, so a caller that wants them gone now runs `gc.collect()`."""
        if self._closed:
            return
        self._closed = True
        groups = {}  # every group both DeviceMeshes and the flattened views made, the expert mesh's own
        # pp, dp_replicate and etp included (leaving those held 9 threads a rank per mesh closed)
        for mesh in (self.world, self.expert, *self._flat.values()):
            for group in mesh.get_all_groups():
                groups[id(group)] = group
        nodes = [part.process_group for part in self._ep_nodes or ()]
        for extra in [
            self._pp_ends,
            *self._cp_parts.values(),
            *self._twin_groups,
            self._checkpoint_group,
            *nodes,
        ]:
            if extra is not None:
                groups[id(extra)] = extra
        for group in groups.values():
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
        self._twins, self._twin_groups, self._checkpoint_group, self._ep_nodes = None, [], None, None

    def mesh(self, dim: str) -> Any:
        """The 1-D DeviceMesh of `dim` that contains this rank."""
        if dim in FLAT_DIMS:
            return self._flat[dim]
        if dim not in self._sliced:  # (the training step asks every step)
            self._sliced[dim] = self.expert[dim] if dim in (Dim.EP, Dim.EDP, Dim.ETP) else self.world[dim]
        return self._sliced[dim]

    def group(self, dim: str) -> CommGroup:
        """The named group of `dim` containing this rank, as the comm layer takes it."""
        if dim == PP_ENDS:
            if self.dims.pp <= 2:  # the ends are the whole pipeline
                return CommGroup(dim, tuple(self.ranks(Dim.PP)), self.mesh(Dim.PP).get_group())
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
