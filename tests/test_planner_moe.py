"""The planner's model of MoE layers and FP8 (issue 48): the expert all-to-alls overlapped phase by phase
beside the other micro-batch's compute, DeepEP's pipelined hops, the experts' share of a layer, FP8 GEMMs
and their casts, DeepSeek-V3 in its published layout, and the search's expert dispatches. (The step model
and search in general: tests/test_planner.py.)"""

from __future__ import annotations

import dataclasses
from itertools import combinations

import pytest

from meshtron.commands.auto_layout import AutoChoice
from meshtron.plan import compute_time
from meshtron.plan.comm_time import EpPieces, Network, Overlap, _once_per_rank, layer_comm, overlapped_ep
from meshtron.plan.compute_time import (
    ComputeEfficiency,
    PassTimes,
    expert_times,
    fp8_cast_elements,
    layer_times,
    matmul_time,
)
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.hardware import accelerator
from meshtron.plan.layout import Layout
from meshtron.plan.network import Group, LinkEfficiency
from meshtron.plan.op_memory import dispatch_kept_elements
from meshtron.plan.routing import hierarchical_rows
from meshtron.plan.search import search
from meshtron.rules.checks import load_config
from meshtron.testing.tiny import LLAMA_1B
from meshtron.testing.tiny import planner_config as config


def test_deepseek_v3_fits_in_its_published_layout():
    """DeepSeek-V3 (with its MTP module) on 2,048 H800 in the report's layout: PP 16 with DualPipe, EP
    64, ZeRO-1 data parallel over the rest, sequences of 4,096, batch 15,360; with full recompute it
    fits on 80 GB (DeepSeek's own partial recompute and float8 activations are not modelled)."""
    cfg = config(["--model.name=deepseek-v3"], seq=4096, batch=15360)
    layout = Layout(pp=16, vpp=2, pp_schedule="dualpipev", ep=64, dp_shard=128, zero=1, micro_batch=1)
    est = estimate(
        dataclasses.replace(layout, recompute="full").apply(cfg), Cluster(accelerator("h800"), 2048)
    )
    assert est.fits and est.memory_bytes_per_gpu < 80 * 2**30


def test_overlapped_all_to_alls_wait_on_the_pieces_they_pair_with():
    """Megatron-Core's combined 1F1B (and DualPipe) run one micro-batch's forward of a layer beside
    another's backward of it in four phases, each pairing one exchange with one piece of compute that
    needs the phase before: combine_b with attention W+F, dispatch_f with the experts' B+W, dispatch_b
    with the experts' F, combine_f with attention B. Each phase takes its longer piece; what exceeds the
    compute is exposed, and the hidden rest slows the compute by the SM share."""
    pieces = EpPieces(dispatch_f=2.0, combine_f=1.0, combine_b=1.0, dispatch_b=2.0)  # T = 6
    attention, experts = PassTimes(f=1.0, b=1.0), PassTimes(f=1.0, b=1.0)  # C = 4
    # phases (1 ‖ 1), (2 ‖ 1), (2 ‖ 1), (1 ‖ 1): the pair takes 6 for 4 of compute, 2 of the 6 exposed,
    # split as the exchanges were (F 3 : B 3).
    assert overlapped_ep(pieces, attention, experts, 0.0) == pytest.approx(PassTimes(f=1.0, b=1.0))
    assert overlapped_ep(pieces, attention, experts, 0.25) == pytest.approx(PassTimes(f=1.5, b=1.5))
    # Compute that dwarfs every piece hides them all, bar the SM share; no compute hides nothing.
    big = PassTimes(f=10.0, b=10.0, w=10.0)
    assert overlapped_ep(pieces, big, big, 0.15) == pytest.approx(pieces.passes * 0.15)
    assert overlapped_ep(pieces, PassTimes(), PassTimes(), 0.15) == pytest.approx(pieces.passes)
    # One long dispatch cannot hide behind the experts' backward alone, however long attention is.
    long = EpPieces(dispatch_f=5.0)
    assert overlapped_ep(long, PassTimes(f=9.0, b=9.0), PassTimes(f=1.0, b=1.0), 0.0).f == pytest.approx(4.0)
    # On a real model the compute hides a short exchange: the estimate's ep part is s of its exposed one.
    model, h800, s = (
        config(["--model.name=deepseek-v3", "--model.n_layers=4"], batch=64),
        accelerator("h800"),
        LinkEfficiency().overlap_sm_share,
    )
    times = {}
    for recompute in ("selective", "full"):
        cfg = Layout(ep=8, dp_shard=8, zero=1, micro_batch=1, recompute=recompute).apply(model)
        exposed = estimate(cfg, Cluster(h800, 8, overlap=Overlap(ep=False)))
        behind = estimate(cfg, Cluster(h800, 8, overlap=Overlap(ep=True)))
        assert behind.time["compute"] == exposed.time["compute"]
        times[recompute] = exposed.time["ep"], behind.time["ep"]
    assert times["selective"][1] == pytest.approx(s * times["selective"][0])
    # Full recompute dispatches again in backward (plan/comm.py): that rerun has no partner, exposed whole.
    (plain, _), (rerun, behind) = times["selective"], times["full"]
    assert rerun > plain and behind == pytest.approx(s * rerun + (1 - s) * (rerun - plain))


def test_the_experts_share_of_a_layer_is_their_matmuls_rows_and_casts(monkeypatch):
    """expert_times: an MoE layer's routed and shared experts' matmuls (F, B and W each once), their rows'
    traffic and, under FP8, their own casts (the attention's stay with the rest); a dense layer has none,
    and the rest of the layer stays positive."""
    cfg = Layout(ep=8, dp_shard=8, zero=1, micro_batch=1).apply(
        config(["--model.name=deepseek-v3", "--model.n_layers=4"], batch=64)
    )
    rates = Cluster(accelerator("h800"), 8).rates("bf16")
    m, rows = cfg.model, 4096
    per_expert = m.top_k * rows / m.n_experts * 8  # each rank's 32 experts share top_k·rows·ep/E rows
    routed = (2 * matmul_time(per_expert, m.dim, m.expert_ffn_dim, rates)
              + matmul_time(per_expert, m.expert_ffn_dim, m.dim, rates)) * (m.n_experts // 8)  # fmt: skip
    s = m.shared_expert_ffn_dim
    shared = 2 * matmul_time(rows, m.dim, s, rates) + matmul_time(rows, s, m.dim, rates)
    assert expert_times(cfg, 3, rates).w == pytest.approx(routed + shared)
    assert expert_times(cfg, 0, rates) == PassTimes()  # DeepSeek-V3's first layers are dense
    rest = layer_times(cfg, 3, rates) - expert_times(cfg, 3, rates)
    assert min(rest.f, rest.b, rest.w) > 0
    fp8 = Cluster(accelerator("h800"), 8, "fp8").rates("bf16")
    with_casts = expert_times(cfg, 3, fp8)
    monkeypatch.setattr(compute_time, "FP8_CAST_BYTES", 0.0)
    casts = with_casts - expert_times(cfg, 3, fp8)
    per_element = 6.0 / (accelerator("h800").hbm_bytes_per_s * fp8.eff.hbm)
    inputs = per_expert * (m.n_experts // 8) * (m.dim + m.expert_ffn_dim) + rows * (m.dim + s)
    assert casts.f == pytest.approx(inputs * per_element) and casts.w == 0


def test_deepeps_pipelined_hops_cost_the_slower_hop():
    """The hierarchical dispatch over 4 nodes of 8: meshtron's hops in sequence cost their sum, DeepEP's
    forwarding (`--overlap ep_hops`) the slower of the two, piece by piece (each dispatch and combine);
    each hop is the dedup exchange of its rows (plan/routing.py) over its own group: 4 ranks across the
    network, 8 over NVLink."""
    cfg = Layout(ep=32, dp_shard=32, zero=1, micro_batch=1).apply(
        config(["--model.name=deepseek-v3", "--model.n_layers=4", "--parallel.ep_dispatch=hierarchical"])
    )
    h800, links = accelerator("h800"), LinkEfficiency()
    tokens, row = 4096, cfg.model.dim * 2
    (_, across, experts_across, _), (_, inside, experts_inside, _) = hierarchical_rows(
        cfg.model, 32, 8, tokens
    )
    net = Network(h800, links, Overlap())
    hops = [
        _once_per_rank(Group(4, 8, 8), net, across, experts_across, row),
        _once_per_rank(Group(8, 1, 8), net, inside, experts_inside, row),
    ]
    in_turn = layer_comm(cfg, 3, net, 0.0)["ep"]
    piped = layer_comm(cfg, 3, Network(h800, links, Overlap(ep_hops=True)), 0.0)["ep"]
    across_hop, inside_hop = hops
    assert piped.f == pytest.approx(
        max(across_hop.dispatch_f, inside_hop.dispatch_f) + max(across_hop.combine_f, inside_hop.combine_f)
    )
    assert piped.b == pytest.approx(
        max(across_hop.combine_b, inside_hop.combine_b) + max(across_hop.dispatch_b, inside_hop.dispatch_b)
    )
    for k in ("f", "b"):
        assert getattr(in_turn, k) == pytest.approx(sum(getattr(h.passes, k) for h in hops))
        # each exchange waits for its own slower hop: at least the slower hop's whole pass
        assert getattr(piped, k) >= max(getattr(h.passes, k) for h in hops)
    assert 0 < piped.f < in_turn.f


def test_fp8_gemms_take_their_own_share_of_the_fp8_peak():
    """FP8 GEMMs at ComputeEfficiency.matmul_fp8 of the doubled peak; attention stays at BF16's."""
    h100 = accelerator("h100")
    bf16, fp8 = Cluster(h100, 8, "bf16").rates("bf16"), Cluster(h100, 8, "fp8").rates("bf16")
    assert fp8.peak == 1979e12 and bf16.peak == 989e12 and fp8.attention_peak == bf16.peak  # datasheet
    assert (fp8.eff.matmul, bf16.eff.matmul) == (ComputeEfficiency().matmul_fp8, 0.6)
    big = (8192, 8192, 8192)  # compute-bound in both
    assert matmul_time(*big, bf16) / matmul_time(*big, fp8) == pytest.approx(1979 * 0.45 / (989 * 0.6))


def test_fp8_casts_move_six_bytes_per_gemm_input_and_output_gradient(monkeypatch):
    """Under FP8 each distinct GEMM input is cast in forward (q, k and v share theirs, as gate and up do)
    and each GEMM's output gradient in backward, at FP8_CAST_BYTES per element through HBM; BF16 GEMMs
    cast nothing."""
    h, q, kv, f, rows = 2048, 2048, 512, 8192, 4096  # llama3-1b: 32 heads, 8 kv heads of 64
    cfg = Layout(tp=1, dp_shard=8, zero=1, micro_batch=1).apply(config(LLAMA_1B))
    assert (cfg.model.dim, cfg.model.ffn_dim, cfg.model.kv_heads_per_rank(1) * cfg.model.head_size) == (
        h,
        f,
        kv,
    )
    forward = rows * h + rows * q + rows * h + rows * f  # x for q/k/v, wo's input, x for gate/up, w2's input
    backward = rows * (q + 2 * kv) + rows * h + rows * 2 * f + rows * h
    assert fp8_cast_elements(cfg, 0, rows) == PassTimes(f=forward, b=backward)
    # MoE: each local expert casts its rows' input and its down-projection's input once.
    moe = Layout(ep=8, dp_shard=8, zero=1, micro_batch=1).apply(
        config(["--model.name=mixtral-8x7b", "--model.n_layers=2"])
    )
    m = moe.model
    routed = m.top_k * rows  # 8 ranks of 1 expert each: each multiplies top_k·rows·8/8 rows
    attention = fp8_cast_elements(moe, 0, rows).f - routed / 8 * 8 * (m.dim + m.expert_ffn_dim)
    assert attention == rows * m.dim + rows * m.n_heads * m.head_size
    # MLA: its two down-projections share x; the latents and wo's input are cast once each.
    mla_cfg = Layout(dp_shard=8, zero=1, micro_batch=1).apply(
        config(["--model.name=deepseek-v3", "--model.n_layers=4"])
    )
    mla = mla_cfg.model
    latents = mla.q_lora_rank + mla.kv_lora_rank + mla.n_heads * mla.v_head_dim
    assert fp8_cast_elements(mla_cfg, 0, rows).f == rows * (mla.dim + latents + mla.dim + mla.ffn_dim)
    h100 = accelerator("h100")
    fp8, bf16 = Cluster(h100, 8, "fp8").rates("bf16"), Cluster(h100, 8, "bf16").rates("bf16")
    with_casts = layer_times(cfg, 0, fp8)
    monkeypatch.setattr(compute_time, "FP8_CAST_BYTES", 0.0)
    without = layer_times(cfg, 0, fp8)
    per_element = 6.0 / (h100.hbm_bytes_per_s * fp8.eff.hbm)
    assert (with_casts - without).f == pytest.approx(forward * per_element)
    assert (with_casts - without).b == pytest.approx(backward * per_element)
    monkeypatch.undo()
    in_bf16 = layer_times(cfg, 0, bf16)
    monkeypatch.setattr(compute_time, "FP8_CAST_BYTES", 0.0)
    assert layer_times(cfg, 0, bf16) == in_bf16  # BF16 GEMMs cast nothing


def test_the_search_tries_deepeps_two_hops_where_ep_crosses_nodes():
    """With the dispatch left open, a layout whose ep group spans whole nodes is tried with the all-to-all
    and with the hierarchical dispatch, and the faster is ranked first (each estimated as that config);
    ep inside a node, or a dispatch the user set, is tried alone."""
    small = ["--model.name=deepseek-v3", "--model.n_layers=4", "--model.vocab_size=32000"]
    cfg = config(small, batch=64)
    cluster = Cluster(accelerator("h800"), 16)
    held = dict(tp=1, pp=1, ep=16, dp_shard=16, zero=1, micro_batch=1, recompute="full")
    plan = search(cfg, cluster, held, top=5)
    tried = {layout.ep_dispatch: est.step_time_s for layout, est in plan.ranked}
    assert set(tried) == {"alltoall", "hierarchical"}
    for dispatch, step in tried.items():
        alone = Layout(**{**held, "ep_dispatch": dispatch}).apply(cfg)
        assert step == pytest.approx(estimate(alone, cluster).step_time_s)
    assert plan.ranked[0][0].ep_dispatch == min(tried, key=tried.__getitem__)
    assert (
        "ep_dispatch=hierarchical"
        in next(x for x, _ in plan.ranked if x.ep_dispatch == "hierarchical").describe()
    )
    # parallel.auto's launched ranks are told the chosen dispatch and experts' grid, not left at defaults
    flags = AutoChoice(cfg, plan.ranked, {}, "").rank_flags()
    assert f"--parallel.ep_dispatch={plan.ranked[0][0].ep_dispatch}" in flags and "--parallel.etp=1" in flags
    inside = search(cfg, cluster, {**held, "ep": 8, "zero": 3}, top=5)
    assert {layout.ep_dispatch for layout, _ in inside.ranked} == {"alltoall"}
    dedup = config([*small, "--parallel.ep_dispatch=dedup"], batch=64)
    assert {layout.ep_dispatch for layout, _ in search(dedup, cluster, held, top=5).ranked} == {"dedup"}


def test_op_recompute_keeps_both_hops_of_the_hierarchical_dispatch():
    """What op recompute keeps of the two-hop dispatch over 2 nodes of 2 ep ranks (8 experts, top 2, 64
    tokens a rank): the in-node hop's rows as the dedup dispatch's, plus those that crossed the network,
    one per token and node holding its experts, each with gates and mask for the node's 4 experts and
    each hop's count table. The expected crossings are counted here over every pair of experts."""
    m = load_config(None, ["--model.name=tiny-moe", "--model.n_experts=8", "--model.top_k=2"]).model
    tokens, h = 64, m.dim
    pairs = list(combinations(range(8), 2))
    nodes_per_token = sum(len({e // 4 for e in pair}) for pair in pairs) / len(pairs)  # experts 0-3: node 0
    ranks_per_token = sum(len({e // 2 for e in pair}) for pair in pairs) / len(pairs)
    crossed, received = round(tokens * nodes_per_token), round(tokens * ranks_per_token)
    one_node = dispatch_kept_elements(m, tokens, 4, "hierarchical", rows=0, per_node=4)
    assert one_node == dispatch_kept_elements(m, tokens, 4, "dedup", rows=0)
    assert one_node == (received * h, received * 2, 16, received * 2)
    two_nodes = dispatch_kept_elements(m, tokens, 4, "hierarchical", rows=0, per_node=2)
    assert two_nodes == (
        (crossed + received) * h,
        crossed * 4 + received * 2,
        4 + 4,
        crossed * 4 + received * 2,
    )
