"""Expert parallel against the single-device run (losses over 6 steps, step-1 gradients of every
expert, router and other weight; tolerances in parity.py) for both dispatchers at ep 2 and 4, dropless
and with capacity, and composed with every other dim; the dispatch itself at module level (round trip,
dispatcher equivalence, skewed routing, exact bytes); HF MoE checkpoints under ep; refusals."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
import torch.nn.functional as F

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import ConfigError, ModelConfig
from meshtron.models.moe import MoE, WeightedSwiGLU, grouped_linear, sort_by_expert, sum_rows
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    merged,
    reference,
    relative,
    run_layout,
    train_rows,
)
from meshtron.testing.tiny import MOE, QWEN2_MOE_SHARED, TINY

# The tiny MoE with every balancing option on: Switch aux loss, z-loss, and the aux-loss-free bias
# (its update moves routing from step 2 on, so the losses check that it is the same on every layout).
EP_MOE = [*MOE, "--model.router_bias_rate=0.01"]
EP2, EP4 = ["--parallel.ep=2"], ["--parallel.ep=4"]
# Capacity drops are discontinuous in the weights: once a few optimizer steps have moved the weights by
# rounding (1e-7 apart between layouts), a near-tied drop can flip on one CPU and not on another (seen:
# an AMD EPYC flipped one at step 4 of ep4_allgather_capacity). At a negligible learning rate every step
# still routes, drops and balances (the bias updates) a new batch, and the decisions stay exact.
NEARLY_FROZEN = "--training.lr=1e-7"
CASES = {
    # name: (world, model overrides, parallel overrides incl. the per-rank micro-batch)
    "ep2_alltoall": (2, [], [*EP2, "--training.micro_batch=4"]),
    "ep2_allgather": (2, [], [*EP2, "--parallel.ep_dispatch=allgather", "--training.micro_batch=4"]),
    "ep4_alltoall": (4, [], [*EP4, "--training.micro_batch=2"]),
    "ep4_allgather": (4, [], [*EP4, "--parallel.ep_dispatch=allgather", "--training.micro_batch=2"]),
    "ep2_alltoall_capacity": (
        2,
        ["--model.capacity_factor=1.5", NEARLY_FROZEN],
        [*EP2, "--training.micro_batch=4"],
    ),
    "ep4_allgather_capacity": (
        4,
        ["--model.capacity_factor=1.25", NEARLY_FROZEN],
        [*EP4, "--parallel.ep_dispatch=allgather", "--training.micro_batch=2"],
    ),
    "ep2_sequence_loss_groups_sigmoid": (
        2,
        [
            "--model.balance_loss=sequence",
            "--model.router=sigmoid",
            "--model.n_expert_groups=2",
            "--model.topk_expert_groups=1",
            "--model.router_scale=2.5",
        ],
        [*EP2, "--training.micro_batch=4"],
    ),
    # dedup: a token once per rank (its group's rank only, under group-limited routing at ep 2)
    "ep2_dedup_groups": (
        2,
        ["--model.router=sigmoid", "--model.n_expert_groups=2", "--model.topk_expert_groups=1"],
        [*EP2, "--parallel.ep_dispatch=dedup", "--training.micro_batch=4"],
    ),
    "ep4_dedup_capacity": (
        4,
        ["--model.capacity_factor=1.25", NEARLY_FROZEN],
        [*EP4, "--parallel.ep_dispatch=dedup", "--training.micro_batch=2"],
    ),
    "ep2_dedup_x_tp2_etp1": (
        4,
        [],
        [
            *EP2,
            "--parallel.ep_dispatch=dedup",
            "--parallel.tp=2",
            "--parallel.etp=1",
            "--training.micro_batch=4",
        ],
    ),
    # edp = 2: expert gradients summed over the expert-data-parallel group, under each ZeRO stage.
    "ep2_x_zero3_edp2": (4, [], [*EP2, "--training.micro_batch=2"]),
    "ep2_x_zero1_edp2": (4, [], [*EP2, "--parallel.zero=1", "--training.micro_batch=2"]),
    "ep2_x_zero2_edp2_allgather": (
        4,
        [],
        [*EP2, "--parallel.zero=2", "--parallel.ep_dispatch=allgather", "--training.micro_batch=2"],
    ),
    "ep2_x_hsdp": (4, [], [*EP2, "--parallel.dp_replicate=2", "--training.micro_batch=2"]),
    "ep2_x_tp2_sp_etp2": (4, [], [*EP2, "--parallel.tp=2", "--parallel.sp=true", "--training.micro_batch=4"]),
    # MoE parallel folding (etp = 1): ep takes tp ranks too, each tp rank sending its share of the tokens
    "ep2_over_tp2_x_dp2": (4, [], [*EP2, "--parallel.tp=2", "--parallel.etp=1", "--training.micro_batch=4"]),
    "ep4_over_tp2_sp_x_dp2": (
        4,
        [],
        [*EP4, "--parallel.tp=2", "--parallel.sp=true", "--parallel.etp=1", "--training.micro_batch=4"],
    ),
    "ep2_within_tp4": (4, [], [*EP2, "--parallel.tp=4", "--parallel.etp=1", "--parallel.dp_shard=1"]),
    "tp2_sp_etp1_experts_replicated": (2, [], ["--parallel.tp=2", "--parallel.sp=true", "--parallel.etp=1"]),
    "ep4_over_tp2_dedup_capacity": (
        4,
        ["--model.capacity_factor=1.25", NEARLY_FROZEN],
        [
            *EP4,
            "--parallel.tp=2",
            "--parallel.etp=1",
            "--parallel.ep_dispatch=dedup",
            "--training.micro_batch=4",
        ],
    ),
    # ep over cp and tp ranks at once (edp 1), recomputing the block in the backward
    "ep4_over_cp2_tp2_selective": (
        4,
        [],
        [*EP4, "--parallel.cp=2", "--parallel.tp=2", "--parallel.etp=1", "--training.recompute=selective"],
    ),
    # edp 2 under the fold: ZeRO-1/2 shard and reduce the experts over the experts' own dp group
    "ep2_over_tp2_zero1_edp2_op_recompute": (
        4,
        [],
        [
            *EP2,
            "--parallel.tp=2",
            "--parallel.etp=1",
            "--parallel.zero=1",
            "--training.recompute=op",
            "--training.micro_batch=4",
        ],
    ),
    "ep2_over_tp2_sp_zero2_edp2": (
        4,
        [],
        [
            *EP2,
            "--parallel.tp=2",
            "--parallel.sp=true",
            "--parallel.etp=1",
            "--parallel.zero=2",
            "--training.micro_batch=4",
        ],
    ),
    # hierarchical: ep 4 over 2 "nodes" of 2 ranks (run.gpus_per_node), tokens cross between them once
    "ep4_hierarchical_two_nodes_capacity": (
        4,
        ["--model.capacity_factor=1.25", NEARLY_FROZEN],
        [*EP4, "--parallel.ep_dispatch=hierarchical", "--run.gpus_per_node=2", "--training.micro_batch=2"],
    ),
    "ep4_over_tp2_hierarchical_two_nodes": (
        4,
        [],
        [
            *EP4,
            "--parallel.tp=2",
            "--parallel.etp=1",
            "--parallel.ep_dispatch=hierarchical",
            "--run.gpus_per_node=2",
            "--training.micro_batch=4",
        ],
    ),
    "pp2_x_ep2_over_tp2": (
        4,
        [],
        [*EP2, "--parallel.pp=2", "--parallel.tp=2", "--parallel.etp=1", "--training.micro_batch=2"],
    ),
    "ep2_x_cp2": (4, [], [*EP2, "--parallel.cp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "ep2_over_cp2": (2, [], [*EP2, "--parallel.cp=2", "--parallel.ep_dispatch=allgather"]),
    "pp2_x_ep2_1f1b": (4, [], [*EP2, "--parallel.pp=2", "--training.micro_batch=2"]),
    "pp2_x_ep2_interleaved": (
        4,
        ["--model.n_layers=4"],
        [
            *EP2,
            "--parallel.pp=2",
            "--parallel.vpp=2",
            "--parallel.pp_schedule=interleaved",
            "--training.micro_batch=2",
        ],
    ),
    "pp2_x_ep2_zero_bubble": (
        4,
        [],
        [*EP2, "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--training.micro_batch=2"],
    ),
    "ep2_full_recompute": (2, [], [*EP2, "--training.recompute=full", "--training.micro_batch=4"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_device(workers, case):
    world, model, parallel = CASES[case]
    micro = [p for p in parallel if "micro_batch" in p] or ["--training.micro_batch=8"]
    results = workers(world).run(run_layout, [*TINY, *EP_MOE, *model, *parallel, *micro])
    pipelined = any("parallel.pp=" in p for p in parallel)  # each stage its own parameters
    ref = reference(workers(1), [*EP_MOE, *model], int(micro[0].split("=")[1]))
    assert_parity(merged(results) if pipelined else results[0], ref)
    for other in results[1:]:
        assert [r["loss"] for r in other["rows"]] == [r["loss"] for r in results[0]["rows"]]
    rows, want = results[0]["rows"], ref["rows"]
    # Clipping's norm counts every expert once (not ep times, nor once per edp shard).
    assert all(relative(r["grad_norm"], w["grad_norm"]) <= 1e-4 for r, w in zip(rows, want, strict=True))
    # The routing statistics (and so the bias updates) are the global batch's, as on one device; a
    # recomputed forward does not count its tokens twice.
    assert [r["moe"] for r in rows] == [r["moe"] for r in want]
    cfg = load_config(None, [*TINY, *EP_MOE, *model])
    tokens = cfg.training.global_batch * cfg.training.seq_len * cfg.model.top_k
    assert all(sum(layer["load"]) == tokens for layer in rows[-1]["moe"].values())


def test_bf16_runs_match_the_single_device_bf16_run(workers, tmp_path):
    """Under bf16 autocast (tokens travel in bf16, gates in fp32 and are folded into the SwiGLU in fp32;
    the outputs are summed in fp32; dedup's partial sums travel back in bf16) each dispatcher trains as the ep = 1 run does, to bf16's precision: with FSDP's bf16
    parameters, ZeRO-2's and ZeRO-1's fp32 ones."""
    base = [*TINY, *EP_MOE, "--training.dtype=bf16", "--training.steps=3", "--training.micro_batch=4"]
    want = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'single'}"])[0]
    for dispatch, zero in [("alltoall", 3), ("dedup", 2), ("allgather", 1)]:
        layout = [*EP2, f"--parallel.ep_dispatch={dispatch}", f"--parallel.zero={zero}"]
        rows = workers(2).run(train_rows, [*base, *layout, f"--run.dir={tmp_path / dispatch}"])[0]
        assert_losses_match(rows, want, rtol=1e-2)


# ---- the dispatch at module level ---------------------------------------------------------------------

MODULE_CFG = ModelConfig(dim=32, n_heads=4, ffn_dim=64, vocab_size=64, n_experts=8, top_k=2, moe_ffn_dim=48)


def random_moe(cfg: ModelConfig) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def spread_experts(moe: MoE, comm: Comm, world: int, dispatch: str, per_node: int = 2) -> ParallelMesh:
    """`moe`'s experts spread over `world` ep ranks by the expert-parallel step (the layer standing in for
    a model), tokens exchanged by `dispatch` (hierarchical: over nodes of `per_node` ranks); returns the
    mesh."""
    mesh = ParallelMesh(ParallelDims(dp_shard=world, ep=world), "cpu")
    model = types.SimpleNamespace(blocks=lambda: iter([("layers.0", types.SimpleNamespace(moe=moe))]))
    nodes = mesh.ep_node_groups(per_node) if dispatch == "hierarchical" else None
    apply_expert_parallel(model, comm, mesh.group("ep"), dispatch, nodes=nodes)
    return mesh


def run_moe(cfg: ModelConfig, dispatch: str | None, skew: bool) -> dict[str, torch.Tensor]:
    """On every rank: its own tokens through an MoE whose experts are spread over all ranks (`dispatch`) or
    all local (None); the output, the input gradient and every expert's gradient gathered to [E, ...]."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    moe, comm = random_moe(cfg), Comm(timeout_s=60)
    x = torch.randn(3, 5, cfg.dim, generator=torch.Generator().manual_seed(rank + 1))
    if skew:  # every token prefers experts 0 and 1: every rank but rank 0 receives nothing
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:2, 0] = torch.tensor([2.0, 1.0])
        x[..., 0] = x[..., 0].abs() + 1
    x.requires_grad_(True)
    mesh = None
    if dispatch is not None:
        mesh = spread_experts(moe, comm, world, dispatch)
    out, _ = moe(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + rank)))
    grads = {name: p.grad for name, p in moe.experts.named_parameters()}
    if mesh is not None:
        grads = {name: comm.all_gather_tensor(g, mesh.group("ep")) for name, g in grads.items()}
        mesh.close()
    return {"out": out.detach(), "x_grad": x.grad, **grads}


@pytest.mark.parametrize("capacity", [0.0, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_dispatchers_match_local_experts(workers, skew, capacity):
    """alltoall, dedup and allgather give the outputs and gradients of the experts run locally (each rank's
    experts' gradients summed over the ranks, as data parallel would), on 4 ranks; with skewed routing
    three ranks receive no tokens and still finish, with zero gradients for the idle experts. With a
    capacity (skewed: most assignments dropped), alltoall exchanges fixed capacity slots instead."""
    pool = workers(4)
    cfg = dataclasses.replace(MODULE_CFG, capacity_factor=capacity)
    local = pool.run(run_moe, cfg, None, skew)
    summed = {name: sum(r[name] for r in local) for name in ("w1", "w3", "w2")}
    for dispatch in ("alltoall", "dedup", "allgather"):
        results = pool.run(run_moe, cfg, dispatch, skew)
        for rank, (got, want) in enumerate(zip(results, local, strict=True)):
            for key in ("out", "x_grad"):  # fp32 sums in another order: relative L2 error <= 1e-5
                error = float((got[key] - want[key]).norm() / want[key].norm())
                assert error <= 1e-5, (dispatch, key, rank, error)
            for name, grad in summed.items():
                torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-4, msg=f"{dispatch} {name}")
        if skew:
            assert all(results[0][name][2:].abs().max() == 0 for name in summed)


def dispatch_bytes(dispatch: str, capacity: float = 0.0) -> dict[str, float]:
    """Bytes and calls of the ep group's token all-to-alls over one forward and backward, with every
    token's k choices spread round-robin over the experts (exactly uniform routing)."""
    world = torch.distributed.get_world_size()
    cfg = dataclasses.replace(MODULE_CFG, capacity_factor=capacity)
    moe, comm = random_moe(cfg), Comm()
    n_tokens = 4 * cfg.n_experts
    experts_Tk = (torch.arange(n_tokens * cfg.top_k) % cfg.n_experts).view(n_tokens, cfg.top_k)

    def uniform_router(x_TD):
        logits = x_TD.float() @ moe.router.weight.float().T
        scores = logits.softmax(-1)
        return scores.gather(1, experts_Tk), experts_Tk, scores, logits

    moe.router.forward = uniform_router
    mesh = spread_experts(moe, comm, world, dispatch)
    x = torch.randn(1, n_tokens, cfg.dim, requires_grad=True)
    out, _ = moe(x)
    out.sum().backward()
    stats = comm.stats
    got = {
        "all_to_all": stats.total_bytes(group="ep", op="all_to_all"),
        "calls": stats.total_calls(group="ep", op="all_to_all"),
    }
    mesh.close()
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_alltoall_moves_the_formula_bytes_exactly(workers, world):
    """Uniform routing: each of the 4 token all-to-alls (dispatch and combine, forward and backward)
    moves top_k·tokens·dim·4 bytes·(ep−1)/ep from each rank, and the rows' gate values travel with them
    (forward) and their gradients back: 2 more of top_k·tokens·4 bytes·(ep−1)/ep."""
    cfg = MODULE_CFG
    n_tokens = 4 * cfg.n_experts
    per_call = cfg.top_k * n_tokens * cfg.dim * 4 * (world - 1) / world
    gates = cfg.top_k * n_tokens * 4 * (world - 1) / world
    for got in workers(world).run(dispatch_bytes, "alltoall"):
        assert got == {"all_to_all": 4 * per_call + 2 * gates, "calls": 6}


@pytest.mark.parametrize("world", [2, 4])
def test_capacity_slots_move_the_capacity_bytes_exactly(workers, world):
    """With a capacity factor of 1.5 each all-to-all moves every expert's C = ceil(1.5·T·k/E) slots,
    filled or not: E·C·dim·4 bytes·(ep−1)/ep from each rank, and each slot's gate value there and its
    gradient back (E·C·4 bytes·(ep−1)/ep each)."""
    cfg = MODULE_CFG
    n_tokens = 4 * cfg.n_experts
    slots = math.ceil(1.5 * n_tokens * cfg.top_k / cfg.n_experts)
    per_call = cfg.n_experts * slots * cfg.dim * 4 * (world - 1) / world
    gates = cfg.n_experts * slots * 4 * (world - 1) / world
    for got in workers(world).run(dispatch_bytes, "alltoall", 1.5):
        assert got == {"all_to_all": 4 * per_call + 2 * gates, "calls": 6}


# DeepSeek-V3's routing at module scale: 16 experts in 4 groups (one per ep rank at ep 4), a token's 4
# experts chosen among the 8 of its best 2 groups.
GROUPED_CFG = dataclasses.replace(
    MODULE_CFG, n_experts=16, top_k=4, router="sigmoid", n_expert_groups=4, topk_expert_groups=2
)


def routed_bytes(dispatch: str) -> dict:
    """On every rank: one forward and backward of its 48 tokens through GROUPED_CFG's MoE spread over 4
    ranks; the ep all-to-alls' bytes and calls, and every rank's expert ids [4, T, k]."""
    rank = torch.distributed.get_rank()
    moe, comm = random_moe(GROUPED_CFG), Comm()
    comm.ranks_per_node = 2  # two "nodes" of 2 ranks: the all-to-alls count what leaves the node
    mesh = spread_experts(moe, comm, 4, dispatch)
    x = torch.randn(1, 48, GROUPED_CFG.dim, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out, _ = moe(x)
    out.sum().backward()
    experts_Tk = moe.router(x.detach()[0])[1]
    got = {
        group: (
            comm.stats.total_bytes(group=group, op="all_to_all"),
            comm.stats.total_calls(group=group, op="all_to_all"),
        )
        for group in ("ep", "ep_intra", "ep_inter")
    }
    got["bytes"], got["calls"] = got["ep"]
    got["network"] = dict(comm.stats.network)
    got["experts"] = comm.all_gather_tensor(experts_Tk[None], mesh.group("ep"), dim=0)
    mesh.close()
    return got


def test_dedup_sends_each_token_once_per_rank_within_its_groups(workers):
    """Under group-limited routing whose groups are the ep ranks, the dedup dispatch sends a token to the
    distinct ranks of its experts (at most topk_expert_groups = 2, where alltoall sends its 4 rows): each
    rank's bytes are exactly, with P its (token, other rank) rows and M the rows other ranks send it,
    P·(x, gates, chosen) + M·(combine) forward and P·(combine's grad) + M·(x's and gates' grads) backward."""
    D, L = GROUPED_CFG.dim, GROUPED_CFG.n_experts // 4
    dedup, alltoall = (workers(4).run(routed_bytes, d) for d in ("dedup", "alltoall"))
    experts = dedup[0]["experts"]  # [source rank, T, k]
    ranks = [[set((e // L).tolist()) for e in source] for source in experts]
    assert max(len(r) for source in ranks for r in source) <= GROUPED_CFG.topk_expert_groups
    for me, (got, flat) in enumerate(zip(dedup, alltoall, strict=True)):
        sent = sum(len(r - {me}) for r in ranks[me])
        received = sum(me in r for source, rows in enumerate(ranks) if source != me for r in rows)
        want = sent * (2 * D * 4 + L * 4 + L) + received * (2 * D * 4 + L * 4)
        assert (got["bytes"], got["calls"]) == (want, 7), me
        assert got["bytes"] < 0.6 * flat["bytes"], (got["bytes"], flat["bytes"])


def dedup_bytes(rows_to: list[list[set[int]]], me: int, width: int, per_row: int) -> int:
    """Bytes rank `me` sends in one forward and backward of a dedup exchange over a group (with `width`
    experts per member): `rows_to[source]` is, per row of that member, the set of members it goes to.
    Its own rows to others carry the token, gates and chosen-mask there and the partial sum's gradient
    back; the rows others send it, the partial sum back and the token's and gates' gradients."""
    sent = sum(len(to - {me}) for to in rows_to[me])
    received = sum(me in to for source, rows in enumerate(rows_to) if source != me for to in rows)
    return sent * (2 * per_row + width * 4 + width) + received * (2 * per_row + width * 4)


def test_hierarchical_crosses_the_network_once_per_node(workers):
    """ep 4 over 2 nodes of 2 ranks, the 4 expert groups on the 4 ranks (a token's experts in 2 groups):
    a token crosses the network (ep_inter: the rank at its index on the other node) only if the other
    node holds one of its experts, once, whatever how many; inside the node (ep_intra) each arrived row
    goes once to each rank holding its experts. Every byte of both is counted against the routing, and
    so is what each dispatch sends off the node (the all-to-alls' own network count): fewer bytes than
    the flat all-to-all's, one row per assignment there."""
    D, L = GROUPED_CFG.dim, GROUPED_CFG.n_experts // 4
    hierarchical, flat = (workers(4).run(routed_bytes, d) for d in ("hierarchical", "alltoall"))
    experts = hierarchical[0]["experts"]  # [source rank, T, k]; rank r on node r // 2
    ranks = [[set((e // L).tolist()) for e in source] for source in experts]
    nodes = [[{r // 2 for r in to} for to in source] for source in ranks]
    for me, (got, alltoall) in enumerate(zip(hierarchical, flat, strict=True)):
        node, index = divmod(me, 2)
        # the network: the ranks at this index on nodes 0 and 1, members 0 and 1 of ep_inter
        inter = dedup_bytes([nodes[index], nodes[2 + index]], node, 2 * L, D * 4)
        assert got["ep_inter"] == (inter, 7), me
        # inside node b: the rows that arrived at each of its ranks, from both nodes' ranks at that index
        arrived = [
            [to & {2 * node, 2 * node + 1} for source in (i, 2 + i) for to in ranks[source]] for i in (0, 1)
        ]
        arrived = [[{r % 2 for r in to} for to in rows if to] for rows in arrived]
        assert got["ep_intra"] == (dedup_bytes(arrived, index, L, D * 4), 7), me
        assert got["ep"] == (0, 0)
        # What leaves the node, counted by the all-to-alls themselves: all of ep_inter's bytes, none of
        # ep_intra's; the flat dispatch sends one row per assignment to a rank on the other node (x and
        # its gate there, the output's gradient back) and answers those it receives (the output, x's and
        # the gate's gradients).
        assert got["network"] == {"ep_inter": inter, "ep_intra": 0}, me
        flat_sent = int(((experts[me] // L) // 2 != node).sum())
        flat_received = sum(int(((experts[s] // L) == me).sum()) for s in range(4) if s // 2 != node)
        assert alltoall["network"]["ep"] == (flat_sent + flat_received) * (2 * D * 4 + 4), me
        assert got["network"]["ep_inter"] < alltoall["network"]["ep"]


def test_sort_and_combine_round_trip_with_empty_experts():
    """Sorting assignments by expert and summing them back per token is the identity (one choice),
    whatever the counts: experts with no tokens, no kept assignment at all, another rank's
    range; the grouped matmul handles empty groups, and its fallback loop (odd widths) agrees."""
    experts_Tk = torch.tensor([[3], [0], [3], [5], [0]])
    x_TD = torch.randn(5, 8)
    for keep_Tk, first, n in [
        (torch.ones(5, 1, dtype=torch.bool), 0, 6),
        (torch.tensor([[True], [False], [True], [True], [False]]), 0, 6),
        (torch.zeros(5, 1, dtype=torch.bool), 0, 6),
        (torch.ones(5, 1, dtype=torch.bool), 3, 3),  # experts 3..5 only
    ]:
        order, counts = sort_by_expert(experts_Tk, keep_Tk, first, n)
        assert counts.tolist() == [
            int(((experts_Tk[:, 0] == first + e) & keep_Tk[:, 0]).sum()) for e in range(n)
        ]
        assert (experts_Tk.flatten()[order].diff() >= 0).all()
        back = sum_rows(x_TD[order], order, 5)
        kept = keep_Tk[:, 0] & (experts_Tk[:, 0] >= first) & (experts_Tk[:, 0] < first + n)
        assert torch.equal(back[kept], x_TD[kept]) and not back[~kept].any()
    counts = torch.tensor([3, 0, 2, 0])
    for dim in (16, 10):  # 16: grouped_mm; 10 (40-byte rows): the per-expert loop
        x, w = (
            torch.randn(5, dim, requires_grad=True),
            torch.randn(4, 6 if dim == 10 else 8, dim, requires_grad=True),
        )
        y = grouped_linear(x, w, counts)
        want = torch.cat([x[:3] @ w[0].T, x[3:5] @ w[2].T])
        torch.testing.assert_close(y, want)
        y.sum().backward()
        assert w.grad[1].abs().max() == 0 and w.grad[3].abs().max() == 0
    empty = grouped_linear(torch.randn(0, 16), torch.randn(4, 8, 16), torch.zeros(4, dtype=torch.long))
    assert empty.shape == (0, 8)


def test_weighted_swiglu_is_the_gate_times_swiglu_with_its_gradients():
    """The gate folded into the experts' activation (Megatron-Core's weighted SwiGLU): the value and the
    gradients of gate, up and weight are autograd's of w·silu(gate)·up, for sorted rows and for
    capacity slots [E, M]; under bf16 inputs it computes in fp32 and returns bf16."""
    for shape in ((7, 6), (3, 4, 6)):
        gate, up = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(2))
        w = torch.rand(shape[:-1], dtype=torch.float64, requires_grad=True)
        probe = torch.randn(shape, dtype=torch.float64)
        ours = torch.autograd.grad((WeightedSwiGLU.apply(gate, up, w) * probe).sum(), (gate, up, w))
        plain = torch.autograd.grad((F.silu(gate) * up * w[..., None] * probe).sum(), (gate, up, w))
        for a, b in zip(ours, plain, strict=True):
            torch.testing.assert_close(a, b)
    half = WeightedSwiGLU.apply(gate.bfloat16(), up.bfloat16(), w.float())
    assert half.dtype == torch.bfloat16


# ---- checkpoints, Hugging Face checkpoints, refusals ----------------------------------------------------


def test_checkpoint_written_under_ep_resumes_on_other_layouts(workers, tmp_path):
    """Save under a folded layout (ep 4 over tp 2 x dp_shard 2, whole experts, ZeRO-3) with the balancing
    bias on; resume on one device, under ep 4 with allgather over dp_shard, under ep 2 x ZeRO-3 (edp 2),
    and folded again with ep 2 over the tp pair: each continues as the uninterrupted single-device run
    does (the bias comes back too)."""
    base = [*TINY, *EP_MOE, "--training.steps=6", "--training.micro_batch=2"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    folded = ["--parallel.tp=2", "--parallel.sp=true", "--parallel.etp=1"]
    first = [*base, *folded, *EP4, "--checkpoint.every=3", "--checkpoint.keep=1", "--training.steps=3"]
    workers(4).run(train_rows, [*first, f"--run.dir={tmp_path / 'first'}"])
    for name, world, layout in [
        ("single", 1, []),
        ("ep4", 4, [*EP4, "--parallel.ep_dispatch=allgather"]),
        ("ep2_zero3", 4, EP2),
        ("ep2_over_tp2", 4, [*folded, *EP2]),
    ]:
        resumed_dir = tmp_path / name
        resumed = [
            *base,
            *layout,
            "--checkpoint.resume=true",
            f"--checkpoint.dir={tmp_path / 'first' / 'checkpoints'}",
        ]
        rows = workers(world).run(train_rows, [*resumed, f"--run.dir={resumed_dir}"])[0]
        assert [r["step"] for r in rows] == [4, 5, 6]
        assert_losses_match(rows, straight[3:])


def hf_moe_logits(path: str, dispatch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face MoE checkpoint loaded, its experts spread over every rank, run on this rank's own
    tokens: (tokens, logits)."""
    from meshtron import hf

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = hf.load(path)
    mesh = ParallelMesh(ParallelDims(dp_shard=world, ep=world), "cpu")
    cfg = load_config(
        None,
        [
            f"--model.n_experts={model.cfg.n_experts}",
            f"--parallel.ep={world}",
            f"--parallel.ep_dispatch={dispatch}",
        ],
    )
    apply_expert_parallel(model, Comm(), mesh.group("ep"), cfg.parallel.ep_dispatch)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits = model(ids)
    mesh.close()
    return ids, logits


# fmt: off
HF_MOE_CASES = {
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared_gate": QWEN2_MOE_SHARED,
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_key_value_heads=2, head_dim=12, moe_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True),
    ),
}
# fmt: on


@pytest.mark.parametrize("dispatch", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", list(HF_MOE_CASES))
def test_hugging_face_moe_checkpoints_under_expert_parallel(workers, tmp_path, case, dispatch):
    pytest.importorskip("transformers")
    from meshtron.testing.tiny import save_tiny_hf_model

    reference_model = save_tiny_hf_model(*HF_MOE_CASES[case], str(tmp_path))
    for ids, logits in workers(2).run(hf_moe_logits, str(tmp_path), dispatch):
        with torch.no_grad():
            expected = reference_model(input_ids=ids).logits
        assert (logits - expected).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([*MOE, "--model.n_experts=6", "--parallel.ep=4"], 4, "use ep in [1, 2, 3, 6]"),
        (
            [*MOE, "--parallel.ep=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
            4,
            "must divide dp_shard*cp=2",
        ),
        (["--parallel.ep=2"], 2, "needs an MoE model"),
        ([*MOE, "--parallel.tp=2", "--parallel.etp=3"], 2, "parallel.etp=3 must be 1"),
        # the two hops need each ep group cut into equal node blocks
        (
            [*MOE, "--parallel.ep=4", "--parallel.ep_dispatch=hierarchical", "--run.gpus_per_node=3"],
            4,
            "not cut into equal blocks",
        ),
        # etp = 1: ep counts every rank splitting the experts, tp ranks included
        (
            [*MOE, "--parallel.ep=8", "--parallel.tp=2", "--parallel.etp=1", "--training.micro_batch=1"],
            8,
            "model.n_experts=4 is not divisible by parallel.ep=8",
        ),
        (
            [
                *MOE,
                "--model.n_experts=6",
                "--parallel.ep=3",
                "--parallel.tp=2",
                "--parallel.etp=1",
                "--training.micro_batch=4",
            ],
            4,
            "parallel.ep=3 must divide dp_shard*cp*tp=4",
        ),
        (
            [
                *MOE,
                "--parallel.ep=2",
                "--parallel.tp=2",
                "--parallel.zero=3",
                "--parallel.fsdp_impl=simple",
                "--parallel.etp=1",
            ],
            2,
            "does not shard experts over their expert-parallel grid",
        ),
        ([*MOE, "--parallel.ep=2", "--parallel.ep_dispatch=alltoal"], 2, "did you mean 'alltoall'"),
        ([*MOE, "--model.n_expert_groups=3"], 1, "not divisible by model.n_expert_groups=3"),
        ([*MOE, "--model.n_expert_groups=4", "--model.topk_expert_groups=1"], 1, "leave at least top_k=2"),
    ],
)
def test_invalid_ep_layouts_are_refused_with_the_fix(overrides, world, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace("[", r"\[").replace("*", r"\*")
    ):
        check(load_config(None, [*TINY, *overrides]), world)


@pytest.mark.parametrize(
    "config, overrides, world",
    [
        ("configs/mixtral-8x7b.toml", [], 64),
        ("configs/mixtral-8x7b.toml", ["--parallel.ep=2", "--parallel.etp=1"], 64),
        (
            "configs/mixtral-8x7b.toml",
            ["--parallel.ep_dispatch=allgather", "--parallel.pp=2", "--parallel.dp_shard=8"],
            64,
        ),
        ("configs/deepseek-moe.toml", [], 64),
        ("configs/deepseek-moe.toml", ["--parallel.cp=2", "--parallel.dp_shard=16"], 64),
    ],
)
def test_moe_presets_validate_for_cluster_layouts(config, overrides, world):
    cfg = check(load_config(config, overrides), world)
    assert cfg.parallel.ep > 1 and cfg.model.n_experts % cfg.parallel.ep == 0
