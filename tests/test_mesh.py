"""Mesh layout: coordinates and groups for several layouts (ep folding included), the live DeviceMesh
groups equal the printed table, and the picture."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch.distributed as dist

from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.pictures.mesh import draw_mesh


def test_tp_is_innermost_and_pp_outermost():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(5) == {
        "pp": 1,
        "dp_replicate": 0,
        "dp_shard": 0,
        "cp": 0,
        "tp": 1,
        "edp": 0,
        "ep": 0,
        "etp": 1,
    }
    # Tied embeddings: the first and last stage of each pipeline, middle stages left out.
    assert ParallelDims(pp=4, tp=2).groups("pp_ends") == [[0, 6], [1, 7]]


def test_full_5d_layout_groups_partition_the_world():
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert dims.world_size == 32
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp"):
        groups = dims.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(32)), dim
        assert all(len(g) == dims.size(dim) for g in groups)
    assert dims.groups("cp")[0] == [0, 2]
    assert dims.groups("dp_replicate")[0] == [0, 8]
    assert dims.groups("dp")[0] == [0, 4, 8, 12]
    assert dims.groups("dp_shard_cp")[0] == [0, 2, 4, 6]
    # Each rank's coordinates rebuild its rank number (row-major over pp, dp_replicate, dp_shard, cp, tp).
    for rank in range(32):
        c = dims.coords(rank)
        assert (((c["pp"] * 2 + c["dp_replicate"]) * 2 + c["dp_shard"]) * 2 + c["cp"]) * 2 + c["tp"] == rank


@pytest.mark.parametrize(
    "dims, ep_groups, edp_groups",
    [
        # ep borrows all of dp_shard: experts spread over the 4 data-parallel ranks of each tp column.
        (
            ParallelDims(dp_shard=4, tp=2, ep=4),
            [[0, 2, 4, 6], [1, 3, 5, 7]],
            [[0], [1], [2], [3], [4], [5], [6], [7]],
        ),
        # ep=2 out of dp_shard=4: two expert groups per tp column, experts replicated over edp=2.
        (ParallelDims(dp_shard=4, ep=2), [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        # ep folds dp_shard x cp together.
        (ParallelDims(dp_shard=2, cp=2, ep=4), [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
        (
            ParallelDims(dp_replicate=2, dp_shard=2, cp=2, ep=2),
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            [[0, 2], [1, 3], [4, 6], [5, 7]],
        ),
        # Whole experts (etp = 1): ep takes the tp ranks first (Megatron's tp 2 x dp 16 with ep 32, small).
        (
            ParallelDims(dp_shard=4, tp=2, ep=8, etp=1),
            [[0, 1, 2, 3, 4, 5, 6, 7]],
            [[0], [1], [2], [3], [4], [5], [6], [7]],
        ),
        (ParallelDims(dp_shard=2, tp=2, ep=2, etp=1), [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        # ep inside each tp group: the tp ranks holding the same experts are their edp
        (
            ParallelDims(dp_shard=2, tp=4, ep=2, etp=1),
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            [[0, 2, 4, 6], [1, 3, 5, 7]],
        ),
        # no ep: whole experts replicated over every rank of the stage, tp's included
        (ParallelDims(pp=2, tp=2, etp=1), [[0], [1], [2], [3]], [[0, 1], [2, 3]]),
    ],
)
def test_expert_parallel_folding(dims, ep_groups, edp_groups):
    assert dims.groups("ep") == ep_groups
    assert dims.groups("edp") == edp_groups
    assert dims.edp * dims.ep * dims.expert_tp == dims.dp_shard * dims.cp * dims.tp


def test_invalid_degrees():
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard\\*cp=4"):
        ParallelDims(dp_shard=4, ep=3)
    with pytest.raises(ValueError, match="ep=4 must divide dp_shard\\*cp=2 when experts are split over tp"):
        ParallelDims(dp_shard=2, tp=2, ep=4)
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard\\*cp\\*tp=4"):
        ParallelDims(dp_shard=2, tp=2, ep=3, etp=1)
    with pytest.raises(ValueError, match="etp=2 must be 1"):
        ParallelDims(dp_shard=2, tp=4, etp=2)
    with pytest.raises(ValueError, match="positive"):
        ParallelDims(tp=0)


def test_nodes_and_crossing_dims():
    dims = ParallelDims(pp=2, dp_shard=4, tp=4)
    assert dims.crossing_dims(gpus_per_node=16) == ["pp"]
    assert set(dims.crossing_dims(gpus_per_node=8)) == {"dp_shard", "pp"}
    assert dims.crossing_dims(gpus_per_node=32) == []
    text = dims.describe(8)
    assert "dims crossing nodes: dp_shard, pp" in text
    assert "tp groups (size 4): [0, 1, 2, 3]" in text


def test_json_and_picture(tmp_path):
    dims = ParallelDims(pp=2, dp_shard=2, cp=2, tp=2, ep=4)
    data = json.loads(dims.to_json())
    assert data["dims"]["tp"] == 2 and data["dims"]["world_size"] == 16
    assert set(data["groups"]) >= {"tp", "cp", "dp_shard", "dp_replicate", "pp", "ep"}
    assert data["groups"]["ep"][0] == [0, 2, 4, 6]
    out = draw_mesh(dims, 8, tmp_path / "mesh.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def live_groups(layout: dict) -> dict:
    """Inside a running job: the ranks of every group containing this rank, read back from the process
    groups torch built (not from our table)."""
    dims = ParallelDims(**layout)
    mesh = ParallelMesh(dims, "cpu")
    out = {}
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "edp", "dp", "dp_shard_cp"):
        group = mesh.group(dim)
        out[dim] = (
            dist.get_process_group_ranks(group.process_group),
            list(group.ranks),
            group.rank,
            mesh.local_rank(dim),
        )
    mesh.close()
    return out


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp_shard=2, tp=2),
        dict(pp=2, cp=2),
        dict(dp_replicate=2, dp_shard=2, ep=2),
        dict(dp_shard=2, cp=2, ep=4),
        dict(dp_shard=2, tp=2, ep=4, etp=1),
    ],
)
def test_device_mesh_groups_equal_the_table(workers, layout):
    dims = ParallelDims(**layout)
    for rank, groups in enumerate(workers(4).run(live_groups, layout)):
        for dim, (torch_ranks, our_ranks, local, mesh_local) in groups.items():
            expected = next(g for g in dims.groups(dim) if rank in g)
            assert torch_ranks == expected == our_ranks, (dim, rank)
            assert local == mesh_local == expected.index(rank)


def threads_after_closing(layout: dict) -> tuple[int, int, int]:
    """This rank's thread count before a mesh of `layout` (with its pair lane and checkpoint group),
    while it is open, and after `close()` and a collection."""
    gc.collect()  # first, what earlier jobs left for the collector: the count after must be this mesh's alone
    before = len(os.listdir("/proc/self/task"))
    mesh = ParallelMesh(ParallelDims(**layout), "cpu")
    mesh.pair_lane()
    mesh.checkpoint_group()
    held = len(os.listdir("/proc/self/task"))
    mesh.close()
    mesh.close()  # a second close does nothing
    del mesh
    gc.collect()
    return before, held, len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_closing_a_mesh_ends_every_groups_threads(workers):
    """Each gloo group keeps threads that poll; a closed mesh must leave none of them, the expert mesh's
    own groups included (its pp, dp_replicate and etp groups were once left open: 9 threads a rank)."""
    for before, held, after in workers(4).run(threads_after_closing, dict(pp=2, dp_shard=2, ep=2, etp=1)):
        assert held > before and after == before, (before, held, after)
