"""The planner's step model and search (issue 13), without processes: the pipeline bubble is the
simulator's on the real layer split, links follow the mesh order, the search holds what --layout fixes,
counts what it drops, and says what is short when nothing fits; `meshtron plan` keeps its contract.
(State bytes and communication bytes against measurement: tests/test_plan.py; activation bytes:
tests/test_activation_memory.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.commands.dry_run import prediction_text
from meshtron.commands.main import main
from meshtron.config.schema import ConfigError
from meshtron.plan.comm_time import (
    Overlap,
    groups,
)
from meshtron.plan.compute_time import (
    PassTimes,
    chunk_times,
)
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.flops import training_flops_per_token
from meshtron.plan.gpu_memory import layer_split, stage_memory
from meshtron.plan.hardware import GiB, accelerator
from meshtron.plan.layout import Layout, parse_layout
from meshtron.plan.network import Group, LinkEfficiency, collective_time
from meshtron.plan.search import search
from meshtron.schedules.actions import Kind
from meshtron.schedules.build import build_schedule, simulate
from meshtron.testing.tiny import LLAMA_1B
from meshtron.testing.tiny import planner_config as config


def test_collective_time_is_the_alpha_beta_model_on_the_right_link():
    gpu = dataclasses.replace(accelerator("h100"), intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9)
    eff = LinkEfficiency(nvlink=0.5, network=1.0, nvlink_latency_s=1e-6, network_latency_s=1e-5)
    inside = Group(size=4, stride=2, gpus_per_node=8)  # ranks 0, 2, 4, 6: one node
    across = Group(size=4, stride=4, gpus_per_node=8)  # ranks 0, 4, 8, 12: two nodes
    assert not inside.crosses_nodes and across.crosses_nodes
    # all-reduce of 1 GB over 4 ranks: 2·3 messages of latency, 2·(3/4) GB at the link's rate
    assert collective_time("all_reduce", 1e9, inside, gpu, eff) == pytest.approx(6e-6 + 1.5e9 / 50e9)
    assert collective_time("all_reduce", 1e9, across, gpu, eff) == pytest.approx(6e-5 + 1.5e9 / 10e9)
    # all-to-all across two nodes of two members each: 1/4 stays on the node, 2/4 leaves it
    assert collective_time("all_to_all", 1e9, across, gpu, eff) == pytest.approx(
        3e-5 + max(0.25e9 / 50e9, 0.5e9 / 10e9)
    )


def test_mesh_order_puts_tp_inside_a_node_and_pp_across():
    cfg = Layout(tp=8, pp=4, dp_shard=2, zero=3).apply(config(LLAMA_1B))
    g = {name: Group(x.size, x.stride, 8) for name, x in groups(cfg).items()}
    assert (g["tp"].stride, g["tp"].crosses_nodes) == (1, False)
    assert (g["shard"].stride, g["shard"].crosses_nodes) == (8, True)
    assert (g["pp"].stride, g["pp"].crosses_nodes) == (16, True)


def test_the_bubble_is_the_simulators_on_the_uneven_layer_split():
    """5 layers on 2 stages split 3 + 2, the head on the second: the planner's pipeline time is the
    simulator's run of these chunk costs (not a closed formula, which assumes equal stages)."""
    cluster = Cluster(accelerator("h100"), 2)
    cfg = Layout(pp=2, dp_shard=1, micro_batch=1, pp_schedule="1f1b").apply(
        config([*LLAMA_1B, "--model.n_layers=5"], batch=8)
    )
    split = layer_split(cfg)
    assert [len(c) for c in split] == [3, 2]
    rates = cluster.rates("bf16")
    costs = [chunk_times(cfg, layers, c == 0, c == 1, rates) for c, layers in enumerate(split)]
    chunk_costs = {(k, c): v for c, x in enumerate(costs) for k, v in ((Kind.F, x.f), (Kind.B, x.b + x.w))}
    sim = simulate(build_schedule(2, 1, 8, "1f1b"), chunk_costs=chunk_costs)
    est = estimate(cfg, cluster)
    assert est.bubble_fraction == pytest.approx(sim.bubble_fraction, abs=0.01)
    pipeline = est.pipeline_s
    assert pipeline == pytest.approx(sim.makespan, rel=0.01)
    assert est.step_time_s > pipeline
    even = 8 * max(x.total for x in costs) + max(x.total for x in costs)  # (m + pp − 1) of the slowest
    assert abs(pipeline - even) / even > 0.02


def test_v_schedules_place_both_ends_on_the_first_stage():
    """zbv on 4 stages: stage 0 holds the embedding and the head (its state and memory say so), the V's
    turn sends nothing, and the simulated bubble is below ZB-H1's on the same layers."""
    from meshtron.plan.comm import step_bytes
    from meshtron.plan.state import rank_parameters

    cluster = Cluster(accelerator("h100"), 4)
    base = config([*LLAMA_1B, "--model.n_layers=16"], batch=16)
    zbv = Layout(pp=4, vpp=2, dp_shard=1, micro_batch=1, pp_schedule="zbv").apply(base)
    h1 = Layout(pp=4, dp_shard=1, micro_batch=1, pp_schedule="zero_bubble").apply(base)
    names = [{x.name for x in rank_parameters(zbv, r)} for r in range(4)]
    assert {"tok_embeddings.weight", "norm.weight"} <= names[0]
    assert not any("tok_embeddings.weight" in n or "norm.weight" in n for n in names[1:])
    pp_bytes = [step_bytes(zbv, 4, r)["pp"] for r in range(4)]
    # Two remote chunk edges at either end, four inside (besides a few bytes of the loss's all-reduce).
    assert pp_bytes[0] == pytest.approx(pp_bytes[1] / 2, rel=1e-6)
    assert pp_bytes[3] == pytest.approx(pp_bytes[2] / 2, rel=1e-6)
    assert estimate(zbv, cluster).bubble_fraction < estimate(h1, cluster).bubble_fraction


def test_estimate_parts_add_up_and_mfu_counts_model_flops_only():
    cluster = Cluster(accelerator("h100"), 16)
    base = config(LLAMA_1B)
    plain = estimate(Layout(tp=2, pp=2, dp_shard=4, zero=1, micro_batch=2).apply(base), cluster)
    recomputed = estimate(
        Layout(tp=2, pp=2, dp_shard=4, zero=1, micro_batch=2, recompute="full").apply(base), cluster
    )
    for est in (plain, recomputed):
        assert sum(est.time.values()) == pytest.approx(est.step_time_s)
        flops = training_flops_per_token(base.model, 4096) * 64 * 4096
        assert est.mfu == pytest.approx(flops / (est.step_time_s * 16 * 989e12))
        assert est.tokens_per_sec_per_gpu == pytest.approx(64 * 4096 / est.step_time_s / 16)
    assert recomputed.step_time_s > plain.step_time_s  # recompute runs more,
    assert recomputed.mfu < plain.mfu  # and MFU does not count it
    assert recomputed.memory["activations"] < plain.memory["activations"] / 2


def test_overlap_and_links_move_the_step_the_right_way():
    base = config(LLAMA_1B)
    layout = Layout(tp=8, dp_shard=2, zero=1, micro_batch=1)
    nvlink = estimate(layout.apply(base), Cluster(accelerator("h100"), 16))
    split_node = estimate(
        layout.apply(base), Cluster(dataclasses.replace(accelerator("h100"), gpus_per_node=4), 16)
    )
    hidden = estimate(layout.apply(base), Cluster(accelerator("h100"), 16, overlap=Overlap(tp=True)))
    assert nvlink.time["tp"] > 0 and "tp" not in hidden.time or hidden.time.get("tp", 0) == 0
    assert split_node.time["tp"] > 3 * nvlink.time["tp"]  # tp = 8 across nodes of 4
    assert hidden.step_time_s < nvlink.step_time_s < split_node.step_time_s


def test_search_holds_fixed_keys_counts_refusals_and_ranks_by_time():
    cluster = Cluster(accelerator("h100"), 16)
    plan = search(config(LLAMA_1B, batch=16), cluster, parse_layout("tp=2,recompute=none"), top=4)
    assert len(plan.ranked) == 4
    times = [est.step_time_s for _, est in plan.ranked]
    assert times == sorted(times)
    for layout, est in plan.ranked:
        assert layout.tp == 2 and layout.recompute == "none" and layout.world_size == 16
        assert est.fits
    assert sum(plan.refused.values()) + len(plan.ranked) <= plan.examined
    assert plan.refused["micro-batches per step must be at least pp"] > 0  # e.g. pp=8, mb=4: 4 < 8


def test_a_fully_fixed_layout_is_evaluated_as_given():
    cluster = Cluster(accelerator("a100-80gb"), 8)
    text = "tp=2,pp=2,vpp=2,pp_schedule=interleaved,cp=1,ep=1,dp_replicate=1,dp_shard=2,zero=1,micro_batch=1,recompute=selective"
    plan = search(config(LLAMA_1B), cluster, parse_layout(text), top=3)
    # the one key left open, the head's weight in the split, is the head's FLOPs in layers: 2·h·V against
    # a Llama 3 1B layer's 2·(2·h·q + 2·h·k + 3·h·f) + 2·q·s (causal core at s = 4096)
    h, q, k, f, v = 2048, 2048, 512, 8192, 128256
    weight = round(2 * h * v / (2 * (2 * h * q + 2 * h * k + 3 * h * f) + 2 * q * 4096), 1)
    assert [layout.describe() for layout, _ in plan.ranked] == [
        f"tp=2,pp=2,pp_schedule=interleaved,vpp=2,pp_head_layers={weight:g},dp_shard=2,zero=1,micro_batch=1,"
        "recompute=selective"
    ]


def test_a_model_that_fits_nowhere_says_what_is_short(capsys):
    code = main(
        [
            "plan",
            "--model.name=llama3-70b",
            "--gpus",
            "2",
            "--gpu",
            "a100-40gb",
            "--seq-len",
            "4096",
            "--global-batch",
            "8",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "fits nowhere" in err and "GiB per GPU" in err and "one GPU has 40.0 GiB" in err
    needs = float(err.split(" GiB per GPU")[0].rsplit("needs ", 1)[1])
    assert needs > 40.0  # the least any layout needs is more than the GPU has


QWEN3_30B_A3B = [
    "--model.n_layers=48", "--model.dim=2048", "--model.n_heads=32", "--model.n_kv_heads=4",
    "--model.head_dim=128", "--model.n_experts=128", "--model.top_k=8", "--model.moe_ffn_dim=768",
    "--model.vocab_size=151936",
]  # fmt: skip


def test_the_screen_refuses_nothing_the_schedule_walk_fits():
    """Interleaved pp=2, vpp=24: the screen's bound counts each of the 49 chunk micro-batches in flight
    as the largest chunk (the head's, with its logits) and said 161 GiB of an 80 GiB H100 where the
    schedule holds 47 GiB; the search then called the model one that "fits nowhere" with 46.8 GiB."""
    cfg = config(QWEN3_30B_A3B, seq=4096, batch=256)
    cluster = Cluster(accelerator("h100"), 16)
    layout = parse_layout("pp=2,vpp=24,ep=8")
    held = {**layout, "dp_shard": 8, "zero": 3, "micro_batch": 1, "recompute": "full"}
    candidate = Layout(
        pp=2, vpp=24, pp_schedule="interleaved", ep=8, dp_shard=8, zero=3, micro_batch=1, recompute="full"
    ).apply(cfg)
    assert not estimate(candidate, cluster, simulated=False).fits and estimate(candidate, cluster).fits
    plan = search(cfg, cluster, held)
    assert len(plan.ranked) == 1 and plan.least_memory is None
    assert all(est.memory_bytes_per_gpu <= 80 * GiB for _, est in search(cfg, cluster, layout).ranked)


def test_a_layout_the_simulator_finds_over_memory_says_what_is_short():
    """Zero-bubble pp 4 with full recompute: the screen's bound (53 GiB) fits a 58 GiB GPU, the
    simulator's walk (61 GiB: inputs waiting for their weight gradients) does not. The plan used to
    name no least-memory layout there, so the user read "no layout is valid: memory" and no figures."""
    cfg = config(QWEN3_30B_A3B, seq=4096, batch=256)
    gpu = dataclasses.replace(accelerator("h100"), memory_bytes=58 * GiB)
    cluster = Cluster(gpu, 16)
    held = dict(
        pp=4,
        pp_schedule="zero_bubble",
        pp_head_layers=0.0,
        ep=4,
        dp_shard=4,
        zero=1,
        micro_batch=1,
        recompute="full",
    )
    candidate = Layout(**held).apply(cfg)
    screen, walked = estimate(candidate, cluster, simulated=False), estimate(candidate, cluster)
    assert screen.memory_bytes_per_gpu < 58 * GiB < walked.memory_bytes_per_gpu
    plan = search(cfg, cluster, held)
    assert plan.ranked == [] and plan.least_memory is not None
    assert plan.least_memory[1].memory_bytes_per_gpu == walked.memory_bytes_per_gpu


def test_plan_json_contract(capsys):
    args = ["plan", "--model.name=llama3-1b", "--model.n_layers=8", "--gpus", "16", "--gpu", "h100"]
    code = main(
        [
            *args,
            "--gpus-per-node",
            "8",
            "--seq-len",
            "4096",
            "--global-batch",
            "32",
            "--top",
            "3",
            "--json",
            "--layout",
            "pp=2",
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and 1 <= len(rows) <= 3
    for row in rows:
        assert {"layout", "step_time_s", "tokens_per_sec_per_gpu", "mfu", "memory_bytes_per_gpu"} <= set(row)
        assert row["layout"]["pp"] == 2 and 0 < row["mfu"] < 1
        assert row["memory_bytes_per_gpu"] <= 80 * GiB
        assert sum(row["step_breakdown_s"].values()) == pytest.approx(row["step_time_s"])
        assert {"compute", "pp_bubble", "dp"} <= set(row["step_breakdown_s"])


def test_plan_table_and_bad_input(capsys):
    args = [
        "plan",
        "--model.name=llama3-1b",
        "--gpus",
        "8",
        "--gpu",
        "h200",
        "--seq-len",
        "2048",
        "--global-batch",
        "16",
    ]
    assert main([*args, "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "layouts examined" in out and "dropped:" in out and " 1 " in out
    assert main([*args, "--layout", "tpp=2"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert main([*args[:5], "h900", *args[6:]]) == 2
    assert "unknown GPU type" in capsys.readouterr().err
    assert main([*args, "--training.steps=3"]) == 2
    assert main([*args, "--moe-imbalance", "0.5"]) == 2
    assert "--moe-imbalance=0.5" in capsys.readouterr().err


def test_parse_layout_refuses_malformed_items():
    assert parse_layout("tp=8, pp=2,recompute=full,sp=false") == {
        "tp": 8,
        "pp": 2,
        "recompute": "full",
        "sp": False,
    }
    with pytest.raises(ConfigError, match="positive integer"):
        parse_layout("tp=0")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_layout("tp")
    # a choice outside its key's values is refused before any search, with the nearest one named
    with pytest.raises(
        ConfigError, match="ep_dispatch=hierarchcal is not one of .*did you mean 'hierarchical'"
    ):
        parse_layout("ep_dispatch=hierarchcal")
    with pytest.raises(ConfigError, match="pp_schedule=1f1 is not one of"):
        parse_layout("pp_schedule=1f1")


def test_pass_times_add_and_scale():
    assert (PassTimes(1, 2, 3) + PassTimes(1, 1, 1)) * 2 == PassTimes(4, 6, 8)


def test_routing_imbalance_loads_the_busiest_expert_rank():
    cluster = Cluster(accelerator("h100"), 16)
    moe = Layout(ep=8, dp_shard=16, zero=1, micro_batch=1).apply(
        config(["--model.name=mixtral-8x7b"], batch=32)
    )
    balanced, skewed = estimate(moe, cluster), estimate(moe, cluster, imbalance=2.0)
    assert skewed.time["compute"] > balanced.time["compute"] and skewed.time["ep"] > balanced.time["ep"]
    assert skewed.memory == balanced.memory
    dense = Layout(tp=2, dp_shard=8, zero=1, micro_batch=1).apply(config(LLAMA_1B))
    assert estimate(dense, cluster, imbalance=2.0) == estimate(dense, cluster)
    with pytest.raises(ValueError, match="at least 1"):
        estimate(moe, cluster, imbalance=0.5)


def test_ranks_sharing_cores_lend_them_to_the_busiest_pipeline_stage():
    """CPU ranks sharing cores: a 4-stage pipeline whose last stage carries the head is bounded by its
    stages' mean work, not by the busiest stage plus the bubble; a layout of equal ranks is unchanged."""
    cfg = Layout(pp=4, dp_shard=1, micro_batch=1, pp_schedule="1f1b").apply(
        config([*LLAMA_1B, "--model.n_layers=4"], seq=1024, batch=8)
    )
    own, shared = Cluster(accelerator("h100"), 4), Cluster(accelerator("h100"), 4, alone_speedup=2.0)
    alone, lent = estimate(cfg, own), estimate(cfg, shared)
    assert lent.step_time_s < alone.step_time_s
    assert sum(lent.time.values()) == pytest.approx(lent.step_time_s)
    assert lent.time["lent_cores"] < 0 and "pp_bubble" not in lent.time
    assert alone.pipeline_s / 2 <= lent.pipeline_s < alone.pipeline_s  # no faster than its critical path
    dense = Layout(dp_shard=4, zero=1, micro_batch=2).apply(config(LLAMA_1B, seq=1024, batch=8))
    assert estimate(dense, shared) == estimate(dense, own)
    # The dry run's step by part shows the lent time too, so its percentages add up to the step.
    rows = [line.split() for line in prediction_text(cfg, shared, "rank").splitlines()]
    percents = {row[0]: float(row[3].rstrip("%")) for row in rows if len(row) >= 4 and row[2] == "s"}
    assert percents["lent_cores"] < 0 and sum(percents.values()) == pytest.approx(100.0, abs=0.3)


def test_no_gpu_stage_finishes_before_its_own_work():
    """Chunk costs rounded to 1% of the largest chunk (the head's) made 48 one-layer chunks' makespan
    3% shorter than their own work: the plan called the gap "lent_cores" on H100s, and its parts summed
    to 102%. Every stage's parts now add up within the step, the rest its bubble."""
    cfg = Layout(
        pp=2, vpp=24, pp_schedule="interleaved", ep=8, dp_shard=8, zero=1, micro_batch=1, recompute="op"
    ).apply(config(QWEN3_30B_A3B, seq=4096, batch=256))
    est = estimate(cfg, Cluster(accelerator("h100"), 16))
    assert "lent_cores" not in est.time and est.time["pp_bubble"] >= 0
    assert sum(est.time.values()) == pytest.approx(est.step_time_s)


def test_overlap_flag_describes_another_frameworks_run(capsys):
    """`--overlap` names what is hidden: meshtron's default listed in the header and the JSON, its own
    names give the default's numbers exactly, and each overlap it drops comes back in the step."""
    args = ["plan", "--model.name=llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
            "--global-batch", "32", "--layout", "tp=4,pp=2,pp_schedule=1f1b,dp_shard=2,zero=1,micro_batch=1,recompute=none"]  # fmt: skip
    assert main(args) == 0
    assert "overlap: dp_reduce,dp_gather,fsdp_prefetch,cp,pp (meshtron's)" in capsys.readouterr().out

    def step(overlap: str | None) -> dict:
        assert main([*args, "--json", *(["--overlap", overlap] if overlap else [])]) == 0
        return json.loads(capsys.readouterr().out)[0]

    default, same = step(None), step("dp_reduce,dp_gather,fsdp_prefetch,cp,pp")
    assert default["overlap"] == ["dp_reduce", "dp_gather", "fsdp_prefetch", "cp", "pp"]
    assert same["step_time_s"] == default["step_time_s"]
    exposed, with_tp = step("none"), step("dp_reduce,dp_gather,fsdp_prefetch,cp,pp,tp")
    assert (
        exposed["overlap"] == []
        and with_tp["step_breakdown_s"]["tp"] == 0 < default["step_breakdown_s"]["tp"]
    )
    assert exposed["step_breakdown_s"]["dp"] > default["step_breakdown_s"]["dp"]
    assert exposed["step_time_s"] > default["step_time_s"] > with_tp["step_time_s"]
    assert main([*args, "--overlap", "dp,tpp"]) == 2
    assert "--overlap=dp,tpp: dp, tpp is not one of dp_reduce, dp_gather" in capsys.readouterr().err
    assert Overlap.parse("none") == Overlap(**{f.name: False for f in dataclasses.fields(Overlap)})


@pytest.mark.parametrize(
    "model, layout",
    [
        (LLAMA_1B, "tp=2,pp=4,pp_schedule=1f1b,dp_shard=2,zero=1,micro_batch=1,recompute=none"),
        (LLAMA_1B, "tp=1,pp=4,pp_schedule=interleaved,vpp=2,dp_shard=4,zero=3,micro_batch=1,recompute=full"),
        (["--model.name=tiny-moe", "--model.n_layers=6", "--model.dense_layers=[0]"],
         "tp=1,pp=2,pp_schedule=zero_bubble,ep=2,dp_shard=8,zero=1,micro_batch=2,recompute=selective"),
    ],
)  # fmt: skip
def test_estimating_each_kind_of_stage_once_gives_every_stages_own_memory(model, layout):
    """The estimate computes stages alike once (plan/state.py stage_signature); its memory must still be
    the most loaded stage's, as stage_memory computes each stage on its own (its schedule walked)."""
    cluster = Cluster(accelerator("h100"), 16)
    cfg = Layout(**parse_layout(layout)).apply(config(model, batch=32))
    want = max(sum(stage_memory(cfg, 16, r, None, cluster.memory).values()) for r in range(cfg.parallel.pp))
    assert estimate(cfg, cluster).memory_bytes_per_gpu == want


def test_plan_says_which_keys_win_over_the_preset(capsys):
    args = ["plan", "--model.name=llama3-1b", "--model.n_layers=8", "--gpus", "8", "--gpu", "h100"]
    assert main([*args, "--seq-len", "4096", "--global-batch", "32", "--top", "1"]) == 0
    assert (
        "note: model.name='llama3-1b' (a preset, named on the command line): n_layers=8 (command line) "
        "in place of its 16" in capsys.readouterr().err
    )
