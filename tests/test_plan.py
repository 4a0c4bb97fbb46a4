"""The planner's model of a layout against what meshtron does on this machine: parameter, gradient and
optimizer-state bytes per rank, and the data-parallel bytes moved per group and step, exactly, for every
engine and the cuts of tp, pp, cp and ep."""

from __future__ import annotations

import itertools

import pytest

from meshtron.commands.dry_run import resolved
from meshtron.observe.metrics import model_state_bytes
from meshtron.plan.comm import exact_groups, step_bytes
from meshtron.plan.comm_time import Overlap
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.hardware import Accelerator
from meshtron.plan.network import LinkEfficiency
from meshtron.plan.routing import ranks_per_token
from meshtron.plan.state import state_bytes
from meshtron.rules.checks import load_config
from meshtron.testing.parity import trainer_for
from meshtron.testing.tiny import MOE, TINY

DATA_GROUPS = {"dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp", "pp_ends", "cp"}
ODD_VOCAB = ["--model.vocab_size=301"]  # tp pads it; ZeRO's row blocks pad it
DEEPSEEK = ["--model.name=tiny-deepseek", "--model.n_layers=2"]
MLA = ["--model.name=tiny-deepseek", "--model.n_experts=0"]
MUON = ["--training.optimizer=muon"]  # latent attention, every layer dense


def measured_state(overrides: list[str]) -> dict:
    """After one step, on every rank: its pipeline stage, whether it is rank 0 of its data-parallel
    shard group (the most loaded), and the bytes it holds."""
    trainer = trainer_for(overrides)
    trainer.step(0)
    second = trainer.step(1)  # the first step also counts DDP's initial broadcast
    mesh = trainer.job.place.mesh
    first = mesh.local_rank("dp_shard_cp") == 0 and mesh.local_rank("dp_replicate") == 0
    return {
        "pp_rank": mesh.local_rank("pp"),
        "first": first,
        "state": model_state_bytes(
            trainer.engine, trainer.optimizer, trainer.job.outer.tensors() if trainer.job.outer else ()
        ),
        "comm": second["comm_bytes_by_group"],
        "calls": second["comm_calls_by_group"],
    }


SIMPLE = ["--parallel.fsdp_impl=simple", "--parallel.zero=3"]
LAYOUTS = {
    "single": (1, []),
    "ddp2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "zero1_4": (4, ["--parallel.zero=1", "--training.micro_batch=2"]),
    "zero2_4": (4, ["--parallel.zero=2", "--training.micro_batch=2"]),
    "zero3_4": (4, ["--parallel.zero=3", "--training.micro_batch=2"]),
    "hsdp_2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "tp2_zero3_2": (4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "pp2_zero1_2_tied": (4, ["--parallel.pp=2", "--parallel.zero=1", "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "cp2_zero2": (2, ["--parallel.cp=2", "--parallel.zero=2"]),
    "cp2_allgather_x_dp2": (4, ["--parallel.cp=2", "--parallel.cp_impl=allgather", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "cp4_alltoall_tp1": (4, ["--parallel.cp=4", "--parallel.cp_impl=alltoall", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "tp2_sp_full_recompute_mqa": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=full", "--model.n_kv_heads=1"]),
    "pp2_interleaved_ddp": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved", "--model.n_layers=4", "--training.micro_batch=2"]),
    "pp2_zbv_zero1_tied_cost": (4, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=zbv", "--parallel.zero=1", "--model.tie_embeddings=true", "--model.n_layers=4", "--parallel.pp_balance=cost", "--training.micro_batch=2"]),
    "moe_tp2_qk_norm": (2, [*MOE, "--parallel.tp=2", "--model.qk_norm=true", "--model.qkv_bias=true"]),
    "moe_ep2_zero3_edp2": (4, [*MOE, "--parallel.ep=2", "--training.micro_batch=2"]),
    # DiLoCo with H = 1: every step carries the outer all-reduce the planner spreads over H steps.
    "diloco_replicas2_zero1": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=1", "--fault_tolerance.diloco_every=1", "--training.micro_batch=2"]),
    "diloco_replicas2_ddp_moe_ep2": (4, [*MOE, "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2", "--fault_tolerance.diloco_every=1", "--training.micro_batch=2"]),
    # One local expert over two edp ranks: the stacks cut within their matrices (config/row_blocks.py).
    "moe_ep2_zero3_experts_cut_within": (4, [*MOE, "--model.n_experts=2", "--parallel.ep=2", "--training.micro_batch=2"]),
    "moe_zero2_experts_cut_within": (4, [*MOE, "--model.n_experts=2", "--parallel.zero=2", "--training.micro_batch=2"]),
    "muon_moe_ep2_zero3_experts_whole": (4, [*MOE, *MUON, "--model.n_experts=2", "--parallel.ep=2", "--training.micro_batch=2"]),
    "moe_ep2_zero1_tp2_etp1": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=1", "--parallel.zero=1", "--training.micro_batch=4"]),
    "moe_ep2_zero2_edp1": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=2", "--training.micro_batch=4"]),
    "moe_ep2_dedup_zero2_edp1": (2, [*MOE, "--parallel.ep=2", "--parallel.ep_dispatch=dedup", "--parallel.zero=2", "--training.micro_batch=4"]),
    "moe_ep4_hierarchical_two_nodes": (4, [*MOE, "--parallel.ep=4", "--parallel.ep_dispatch=hierarchical", "--run.gpus_per_node=2", "--training.micro_batch=2"]),
    # Routing-free exchanges, exact: a capacity's slots (C from all the layer's tokens, also under etp 1),
    # the all-gather dispatch; full recompute (and op with op_recompute_dispatch=rerun) dispatches again,
    # op recompute keeps the dispatch's outputs; bf16 rows and gates take 2 bytes.
    "moe_ep2_capacity_full_recompute": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=2", "--model.capacity_factor=1.5", "--training.recompute=full", "--training.micro_batch=4"]),
    "moe_ep2_capacity_tp2_sp_etp1_bf16": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.sp=true", "--parallel.etp=1", "--model.capacity_factor=1.25", "--training.dtype=bf16", "--training.micro_batch=4"]),
    "moe_ep2_allgather_op_recompute": (2, [*MOE, "--parallel.ep=2", "--parallel.zero=2", "--parallel.ep_dispatch=allgather", "--training.recompute=op", "--training.micro_batch=4"]),
    "moe_ep2_capacity_op_recompute_rerun": (2, [*MOE, "--parallel.ep=2", "--model.capacity_factor=1.5", "--training.recompute=op", "--training.op_recompute_dispatch=rerun", "--training.micro_batch=4"]),
    "moe_ep2_allgather_tp2_etp1_bf16": (4, [*MOE, "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=1", "--parallel.ep_dispatch=allgather", "--training.dtype=bf16", "--training.micro_batch=4"]),
    # bf16: whole parameters once in bf16 beside fp32 masters (whole, or owned rows); ZeRO-3 as in fp32
    "bf16_single": (1, ["--training.dtype=bf16"]),
    "bf16_ddp2": (2, ["--training.dtype=bf16", "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "bf16_zero1_4": (4, ["--training.dtype=bf16", "--parallel.zero=1", "--training.micro_batch=2"]),
    "bf16_zero2_4": (4, ["--training.dtype=bf16", "--parallel.zero=2", "--training.micro_batch=2"]),
    "bf16_zero3_4": (4, ["--training.dtype=bf16", "--parallel.zero=3", "--training.micro_batch=2"]),
    "bf16_pp2_zero1_2_tied": (4, ["--training.dtype=bf16", "--parallel.pp=2", "--parallel.zero=1", "--model.tie_embeddings=true", "--training.micro_batch=2"]),
    "bf16_moe_ep2_zero2_tp2": (4, [*MOE, "--training.dtype=bf16", "--parallel.ep=2", "--parallel.tp=2", "--parallel.zero=2", "--training.micro_batch=4"]),
    # Muon: one fp32 momentum per matrix element; its owners' all-to-alls over dp (and tp for what tp cuts)
    "muon_ddp2": (2, [*MUON, "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "muon_zero2_4": (4, [*MUON, "--parallel.zero=2", "--training.micro_batch=2"]),
    "muon_bf16_zero1_4": (4, [*MUON, "--training.dtype=bf16", "--parallel.zero=1", "--training.micro_batch=2"]),
    "muon_zero3_tp2_2": (4, [*MUON, "--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "muon_fp32_zero1_cp2_2": (4, [*MUON, "--training.muon_ns_dtype=fp32", "--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.zero=1", "--training.micro_batch=4"]),
    "muon_moe_ep2_zero3_edp2_tp2": (4, [*MOE, *MUON, "--parallel.ep=2", "--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    # A recomputed attention sends its cp exchange again: the ring's and the gathered kv, or Ulysses' q, k,
    # v (and o when the whole block or every op reruns, not the attention core alone)
    "cp2_ring_full_recompute": (2, ["--parallel.cp=2", "--parallel.dp_shard=1", "--training.recompute=full", "--training.micro_batch=4"]),
    "cp2_allgather_op_recompute": (2, ["--parallel.cp=2", "--parallel.cp_impl=allgather", "--parallel.dp_shard=1", "--training.recompute=op", "--training.micro_batch=4"]),
    "cp2_alltoall_selective_tp2": (4, ["--parallel.cp=2", "--parallel.cp_impl=alltoall", "--parallel.tp=2", "--parallel.dp_shard=1", "--training.recompute=selective", "--training.micro_batch=4"]),
    "mla_cp2_alltoall_full_recompute": (2, [*MLA, "--parallel.cp=2", "--parallel.cp_impl=alltoall", "--training.recompute=full"]),
    # A recomputed block reruns its experts' unit (ZeRO-3 over edp): gathered once for the rerun and its
    # backward, with no prefetch of the next layer's experts (reduced already: a gather thrown away)
    "moe_ep2_zero3_full_recompute": (4, [*MOE, "--parallel.ep=2", "--training.recompute=full", "--training.micro_batch=2"]),
    "moe_tp2_etp1_zero3_op_recompute": (2, [*MOE, "--parallel.tp=2", "--parallel.etp=1", "--parallel.dp_shard=1", "--parallel.zero=3", "--training.recompute=op", "--training.micro_batch=4"]),
    # ZeRO-3 under interleaving: each unit gathered twice per micro-batch, prefetches kept inside the chunk
    # running (a block's prefetch of the next chunk's first block gathered it once more)
    "pp2_interleaved_zero3": (4, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved", "--model.n_layers=4", "--parallel.zero=3", "--training.micro_batch=2"]),
    # Split backward: a unit gathered for B is freed after it (its W needs no parameters) and reduced once
    # per micro-batch (its norms' gradients come in B, its linear layers' in W); a V's first rank gathers
    # the root for each of its two chunks, and a tied embedding there takes a gradient from each chunk
    "pp2_zero_bubble_zero3": (4, ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--model.n_layers=4", "--parallel.zero=3", "--training.micro_batch=2"]),
    "pp2_zbv_zero3_bf16": (4, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=zbv", "--model.n_layers=4", "--parallel.zero=3", "--training.dtype=bf16", "--training.micro_batch=2"]),
    "pp2_dualpipev_zero3_tied_mtp": (4, [*DEEPSEEK, "--model.n_layers=4", "--model.tie_embeddings=true", "--model.mtp_depth=1", "--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=dualpipev", "--parallel.zero=3", "--training.micro_batch=1"]),
    # Multi-token prediction: each depth's loss all-reduced with the main one, over dp and from the last
    # stage; its module a ZeRO-3 unit of the last chunk (the root's second logits once prefetched it again)
    "mtp2_zero3_4": (4, [*DEEPSEEK, "--model.mtp_depth=2", "--parallel.zero=3", "--training.micro_batch=2"]),
    "mtp_pp2_zero3": (4, [*DEEPSEEK, "--model.mtp_depth=1", "--parallel.pp=2", "--parallel.zero=3", "--training.micro_batch=2"]),
    "mtp_pp2_interleaved_ep2_zero3": (4, [*DEEPSEEK, "--model.mtp_depth=1", "--model.n_layers=4", "--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved", "--parallel.ep=2", "--parallel.zero=3", "--training.micro_batch=2"]),
    # Multi-head latent attention (dense): its parameters per rank, and what each cp exchange sends
    "mla_tp2_zero3": (4, [*MLA, "--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "mla_cp2_ring_kv": (2, [*MLA, "--parallel.cp=2", "--parallel.cp_exchange=kv"]),
    "mla_cp2_ring_latent": (2, [*MLA, "--parallel.cp=2", "--parallel.cp_exchange=latent"]),
    "mla_cp2_allgather_latent": (2, [*MLA, "--parallel.cp=2", "--parallel.cp_impl=allgather", "--parallel.cp_exchange=latent"]),
    "mla_cp2_alltoall": (2, [*MLA, "--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "mla_cp2_ring_latent_x_tp2": (4, [*MLA, "--parallel.cp=2", "--parallel.cp_exchange=latent", "--parallel.tp=2", "--parallel.sp=true"]),
    # SimpleFSDP: a gather per parameter read and again in backward where the read needs the weight, a
    # reduce-scatter per read (the embedding's lookup gathers once; a tied head and each MTP depth read
    # again; recompute's reruns stand in for backward's gathers)
    "simple_tied_tp2_sp": (4, [*SIMPLE, "--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_shard=2", "--model.tie_embeddings=true", "--training.micro_batch=4"]),
    "simple_mtp_pp2_full_recompute": (4, [*DEEPSEEK, *SIMPLE, "--model.mtp_depth=1", "--parallel.pp=2", "--training.recompute=full", "--training.micro_batch=2"]),
    "simple_moe_bf16_op_recompute": (2, [*MOE, *SIMPLE, "--training.dtype=bf16", "--training.recompute=op", "--training.micro_batch=4"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_predicted_state_and_traffic_equal_measured(workers, case):
    world, layout = LAYOUTS[case]
    overrides = [*TINY, *ODD_VOCAB, *layout]
    micro = [] if any("micro_batch" in o for o in layout) else ["--training.micro_batch=8"]
    cfg = load_config(None, [*overrides, *micro])
    for result in workers(world).run(measured_state, [*overrides, *micro]):
        if result["first"]:
            assert result["state"] == state_bytes(cfg, world, result["pp_rank"]), result["pp_rank"]
            # What the formula holds exact (data-parallel, pipeline, dense context-parallel and
            # routing-free expert traffic); tp and the routed ep exchanges are leading terms.
            exact = exact_groups(cfg)
            assert exact >= DATA_GROUPS - {"cp"}
            want = {g: b for g, b in step_bytes(cfg, world, result["pp_rank"]).items() if g in exact}
            got = {g: b for g, b in result["comm"].items() if g in exact}
            assert got == pytest.approx(want, rel=1e-9), result["pp_rank"]
            if case in MESSAGES:
                assert latency_only(cfg, world) == MESSAGES[case](result["calls"])


def latency_only(cfg, world: int) -> dict[str, float]:
    """The planner's communication seconds by dim on links of infinite bandwidth, 1 s per message and
    no overlap: the messages it charges."""
    links = Accelerator(
        name="latency",
        bf16_flops_per_s=1e15,
        fp8_flops_per_s=None,
        memory_bytes=2**50,
        hbm_bytes_per_s=1e15,
        intra_node_bytes_per_s=1e30,
        inter_node_bytes_per_s=1e30,
        gpus_per_node=world,
    )
    nothing_hidden = Overlap(**{f: False for f in Overlap.__dataclass_fields__})
    cluster = Cluster(links, world, links=LinkEfficiency(1.0, 1.0, 1.0, 1.0), overlap=nothing_hidden)
    times = estimate(resolved(cfg, world), cluster).time
    return {dim: round(times[dim], 6) for dim in ("dp", "tp", "cp", "ep") if times.get(dim)}


# The messages (one latency each: an all-reduce over n ranks sends 2·(n−1), an all-gather, reduce-scatter
# or all-to-all n−1, a ring hop's send and receive together 1) of the collectives meshtron counted in
# one step. The planner puts the loss's and clipping's all-reduces under dp, except clipping's over tp.
MESSAGES = {
    # FSDP: one gather forward, one backward, one reduce-scatter per unit (2 blocks and the root); 1 clip
    "zero3_4": lambda c: {"dp": (c["dp_shard"] - 1) * 3 + 6 + c["dp"] * 6},
    # ZeRO-2: one bucket's reduce-scatter, a post-step gather per unit (3), clipping's all-reduce.
    "cp2_zero2": lambda c: {"dp": (c["dp_shard_cp"] - 1) * 1 + 2 + c["dp_cp"] * 2, "cp": c["cp"] / 2},
    "tp2_zero3_2": lambda c: {"dp": (c["dp_shard"] - 1) * 1 + 2 + c["dp"] * 2, "tp": (c["tp"] - 1) * 2},
    # alltoall: per MoE layer the count table's all-gather, the rows and their gates each way, forward and
    # backward (6 all-to-alls)
    "moe_ep2_zero2_edp1": lambda c: {"dp": (c["dp_shard"] - 1) * 1 + 2 + c["dp"] * 2, "ep": c["ep"]},
    # dedup: per MoE layer the count table's all-gather, 4 all-to-alls forward and 3 backward
    "moe_ep2_dedup_zero2_edp1": lambda c: {"dp": (c["dp_shard"] - 1) * 1 + 2 + c["dp"] * 2, "ep": c["ep"]},
    # a capacity's slots: per MoE layer the rows and their gates each way, forward and backward, and the
    # rerun forward's dispatch again (8 all-to-alls, no count table)
    "moe_ep2_capacity_full_recompute": lambda c: {
        "dp": (c["dp_shard"] - 1) * 1 + 2 + c["dp"] * 2,
        "ep": c["ep"],
    },
    # the all-gather dispatch: 4 gathers and a reduce-scatter forward, 2 reduce-scatters and a gather
    # backward; op recompute's rerun takes the 4 gathers' outputs from its store
    "moe_ep2_allgather_op_recompute": lambda c: {
        "dp": (c["dp_shard"] - 1) * 1 + 2 + c["dp"] * 2,
        "ep": c["ep"],
    },
    # hierarchical: the dedup exchange's calls over the nodes and inside each (2 ranks each: 1 message)
    "moe_ep4_hierarchical_two_nodes": lambda c: {
        "dp": (c["dp_shard"] - 1) * 3 + 6 + c["dp"] * 6,
        "ep": c["ep_inter"] + c["ep_intra"],
    },
}


PIPELINES = {
    "1f1b": (2, ["--parallel.pp=2"]),
    "gpipe": (2, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"]),
    "interleaved": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=interleaved"]),
    "zero_bubble": (2, ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble"]),
    "zbv": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=zbv"]),
    "dualpipev": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_schedule=dualpipev"]),
    "pp4_bf16": (4, ["--parallel.pp=4", "--training.dtype=bf16"]),
    "pp2_tp2_sp": (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.sp=true"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipeline_traffic_equals_the_formula(workers, case):
    """Each stage's sends and receives, exactly: the formula once counted both a send and a receive per
    message each way (`meshtron verify` printed counted/formula 0.500 for every pipeline)."""
    world, layout = PIPELINES[case]
    overrides = [*TINY, "--model.n_layers=4", "--training.micro_batch=2", *layout]
    cfg = load_config(None, overrides)
    for result in workers(world).run(measured_state, overrides):
        assert result["comm"]["pp"] == pytest.approx(
            step_bytes(cfg, world, result["pp_rank"])["pp"], rel=1e-9
        )


def test_a_v_schedule_in_a_layout_implies_two_chunks_per_rank():
    """`--layout "pp=16,pp_schedule=dualpipev"` is a V of two chunks per rank, as a config's is (without
    it the planner indexed chunks that the split did not have)."""
    from meshtron.plan.layout import parse_layout

    assert parse_layout("pp=4,pp_schedule=dualpipev")["vpp"] == 2
    assert parse_layout("pp=4,pp_schedule=zbv,vpp=2") == {"pp": 4, "pp_schedule": "zbv", "vpp": 2}
    assert "vpp" not in parse_layout("pp=4,pp_schedule=1f1b")


@pytest.mark.parametrize(
    "experts, top_k, groups, best, ep",
    [(8, 2, 1, 1, 4), (8, 2, 4, 2, 4), (8, 3, 4, 2, 2), (8, 2, 2, 1, 4), (12, 3, 3, 2, 3), (12, 3, 3, 2, 6)],
)
def test_ranks_a_token_reaches_by_enumeration(experts, top_k, groups, best, ep):
    """plan/routing.py's expectation of the ranks the dedup dispatch sends a token to, against the mean
    over every equally likely routing (each best-groups subset, then each top_k subset of its experts):
    blocks within a group, blocks spanning groups, no groups."""
    routing = [f"--model.n_experts={experts}", f"--model.top_k={top_k}", f"--model.n_expert_groups={groups}"]
    cfg = load_config(None, [*MOE, *routing, f"--model.topk_expert_groups={best}"]).model
    block, per_group = experts // ep, experts // groups
    counts = [
        len({e // block for e in chosen})
        for group_set in itertools.combinations(range(groups), best)
        for chosen in itertools.combinations(
            [e for g in group_set for e in range(g * per_group, (g + 1) * per_group)], top_k
        )
    ]
    assert ranks_per_token(cfg, ep) == pytest.approx(sum(counts) / len(counts), rel=1e-12)
