"""Per-operation selective recompute (`training.recompute = "op"`, parallel/recompute.py): parity with the
single-device run without recompute in every layout (losses over 6 steps, step-1 gradients: parity.py's
tolerances), both policies; what each block keeps equals plan/memory.py's formula exactly; the planner
models it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import meshtron.comm.kept_outputs as kept_outputs
import meshtron.parallel.recompute as recompute
from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import ConfigError, ModelConfig
from meshtron.models.llama import build_model
from meshtron.models.moe import GroupedExperts
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.plan.estimate import Cluster, estimate
from meshtron.plan.hardware import accelerator
from meshtron.plan.layout import Layout
from meshtron.plan.memory import layer_activation_bytes
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import assert_parity, merged, reference, run_layout
from meshtron.testing.tiny import MOE, TINY

OP = ["--training.recompute=op"]
EVERY_OTHER = [*OP, "--training.op_recompute_saves=every_other_matmul"]
CASES = {
    # name: (world, model overrides, parallel overrides incl. the per-rank micro-batch)
    "one_device": (1, [], OP),
    "one_device_every_other": (1, [], EVERY_OTHER),
    "moe_every_other": (1, MOE, EVERY_OTHER),
    "zero3_dp2": (2, [], [*OP, "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "tp2_sp": (2, [], [*EVERY_OTHER, "--parallel.tp=2", "--parallel.sp=true"]),
    # The attention's reduce-scatter kept and replayed; one sequence per micro-batch, where the scatter's
    # input is its own contiguous buffer (a kept partial sum must not be reduced in place); latent attention.
    "tp2_sp_mla_micro1": (2, ["--model.name=tiny-deepseek"], [*OP, "--parallel.tp=2", "--parallel.sp=true", "--training.micro_batch=1"]),
    # Row-parallel partial sums are kept and then reduced: the reduction must copy them, not reduce in place.
    "tp2_moe": (2, [*MOE, "--model.router_bias_rate=0.01"], [*OP, "--parallel.tp=2"]),
    "cp2_ring": (2, [], [*OP, "--parallel.cp=2"]),
    "cp2_alltoall": (2, [], [*EVERY_OTHER, "--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "ep2_alltoall": (2, MOE, [*OP, "--parallel.ep=2", "--training.micro_batch=4"]),
    "ep2_dedup_rerun": (2, MOE, [*OP, "--parallel.ep=2", "--parallel.ep_dispatch=dedup", "--training.op_recompute_dispatch=rerun", "--training.micro_batch=4"]),
    "pp2_1f1b": (2, [], [*OP, "--parallel.pp=2", "--training.micro_batch=2"]),
    # The dispatch's outputs kept and replayed: both hops of the hierarchical one (2 "nodes" of 2 ranks),
    # the tp ranks' token shares under etp 1, a DualPipeV pair's two threads, zero-bubble's split backward.
    "ep4_hierarchical": (4, MOE, [*OP, "--parallel.ep=4", "--parallel.dp_shard=4", "--parallel.ep_dispatch=hierarchical", "--run.gpus_per_node=2", "--training.micro_batch=2"]),
    "tp2_ep2_etp1_allgather": (4, MOE, [*OP, "--parallel.tp=2", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.etp=1", "--parallel.ep_dispatch=allgather", "--training.micro_batch=4"]),
    "dualpipev_overlap_ep2": (4, [*MOE, "--model.n_layers=4"], [*OP, "--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--parallel.vpp=2", "--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.zero=1", "--training.micro_batch=1", "--parallel.pp_overlap=true"]),
    "zero_bubble_ep2_capacity": (4, [*MOE, "--model.capacity_factor=1.5"], [*OP, "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--parallel.dp_shard=2", "--parallel.ep=2", "--training.micro_batch=2"]),
    "pp2_zero_bubble": (2, [], [*OP, "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--training.micro_batch=2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_device(workers, case):
    world, model, parallel = CASES[case]
    micro = [] if any("micro_batch" in p for p in parallel) else ["--training.micro_batch=8"]
    results = workers(world).run(run_layout, [*TINY, *model, *parallel, *micro])
    pipelined = any("parallel.pp=" in p for p in parallel)
    micro_batch = int([p for p in [*parallel, *micro] if "micro_batch" in p][0].split("=")[1])
    ref = reference(workers(1), model, micro_batch)  # the same gradient sums: MoE routing stays exact
    assert_parity(merged(results) if pipelined else results[0], ref)


def test_compiled_blocks_are_refused():
    """Compiled blocks run their graph past the dispatch mode that keeps outputs: refused, with the fix."""
    with pytest.raises(ConfigError, match="recompute='full' or 'selective' with compile"):
        check(load_config(None, [*TINY, *OP, "--training.compile=true"]))


def kept_bytes(
    cfg: ModelConfig,
    saves: str,
    keep_attention: bool = True,
    model=None,
    seed: int = 0,
    keep_dispatch: bool = True,
    sp: int = 1,
) -> list[int]:
    """Per block: the bytes op recompute keeps from forward to backward, measured: the outputs its
    policy stored (torch's selective-checkpoint store, read through its private `storage`: the only way
    to see them), the collective outputs it kept (comm/kept_outputs.py) and the block's input, which
    the checkpoint keeps (1/`sp` of the sequence). `model`: one already parallelized, else a fresh one."""
    stores, collectives = [], []
    original, kept_class = recompute.create_selective_checkpoint_contexts, recompute.KeptOutputs

    def spy(policy):
        forward, rerun = original(policy)
        stores.append(forward.storage)
        return forward, rerun

    def spied_collectives(*args):
        collectives.append(kept_class(*args))
        return collectives[-1]

    model = build_model(cfg, seed=0) if model is None else model
    recompute.apply_recompute(model, "op", saves, keep_attention, keep_dispatch)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(seed))
    recompute.create_selective_checkpoint_contexts, recompute.KeptOutputs = spy, spied_collectives
    try:
        logits, aux = model(tokens[:, :-1], return_aux=True)
    finally:
        recompute.create_selective_checkpoint_contexts, recompute.KeptOutputs = original, kept_class
    block_input = 2 * 32 * cfg.dim * 4 // sp
    out = []
    for store, kept in zip(stores, collectives, strict=True):
        values = [getattr(w, "val", None) for by_index in store.values() for saved in by_index.values()
                  for w in (saved if isinstance(saved, tuple) else (saved,))]  # fmt: skip
        values += [tensor for tensor, *_ in kept.outputs]
        storages = {
            v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
            for v in values
            if isinstance(v, torch.Tensor)
        }
        out.append(block_input + sum(storages.values()))
    (logits.float().square().mean() + aux).backward()  # (any loss: tp's logits are a vocabulary shard)
    return out


DENSE = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
MOE_MODEL = dataclasses.replace(
    DENSE, n_experts=4, top_k=2, moe_ffn_dim=48, n_shared_experts=1, shared_expert_gate=True
)
# MLA: a query latent (or none), the key/value latent, up-projections of N + R and N + Dv per head.
LATENT = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
MODELS = {
    "dense": DENSE,
    "moe": MOE_MODEL,
    "mla_moe": dataclasses.replace(MOE_MODEL, n_kv_heads=4, **LATENT),
    "mla_no_query_latent": dataclasses.replace(DENSE, n_kv_heads=4, **{**LATENT, "q_lora_rank": 0}),
}


@pytest.mark.parametrize("saves", ["matmuls", "every_other_matmul", "matmuls_but_mla_up"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("keep_attention", [True, False], ids=["attention_kept", "attention_recomputed"])
def test_kept_bytes_equal_the_formula(model, saves, keep_attention):
    """Every matmul's output (or every other one's, counted in forward order, or all but MLA's
    up-projections), the attention kernel's output and log-sum-exp (not under cp), the block input:
    plan/memory.py's op terms, to the byte."""
    cfg = MODELS[model]
    if saves == "matmuls_but_mla_up" and not cfg.is_mla:
        pytest.skip("refused for models without MLA (test_bad_policy_is_refused)")
    measured = kept_bytes(cfg, saves, keep_attention)
    cp = 1 if keep_attention else 2  # the formula's cp = 2 means: attention recomputed (seq 64 / 2 = 32)
    want = layer_activation_bytes(
        cfg,
        2,
        32 * cp,
        recompute="op",
        cp=cp,
        op_saves=saves,
        kept=2 * 32 * cfg.top_k,
        assignments=2 * 32 * cfg.top_k,
    )
    assert measured == [want] * cfg.n_layers


def delivered_rows(picks: list[torch.Tensor], rank: int, per_node: int, local: int) -> tuple[int, int]:
    """From every ep rank's chosen experts [T, k] of one layer (ep ranks node-major, `per_node` a node,
    `local` experts each): the (token, rank) rows the dedup dispatch, or the hierarchical one's in-node
    hop, delivers to `rank` (every token with an expert on it), and the rows the hierarchical network
    hop delivers to it (the tokens of the ranks at its index on every node that have an expert on its
    node)."""
    node, index = divmod(rank, per_node)

    def reaching(experts_Tk: torch.Tensor, first: int, count: int) -> int:
        return int(((experts_Tk >= first) & (experts_Tk < first + count)).any(-1).sum())

    pairs = sum(reaching(p, rank * local, local) for p in picks)
    block = per_node * local
    crossed = sum(reaching(p, node * block, block) for s, p in enumerate(picks) if s % per_node == index)
    return pairs, crossed


def kept_bytes_over_ep(dispatch: str, capacity: float, per_node: int) -> dict:
    """On each ep rank (each its own tokens; nodes of `per_node` ranks for the hierarchical dispatch):
    what op recompute keeps per block, keeping the dispatch's outputs ("op") and sending it again
    ("op_rerun"), the rows the block's experts processed in forward, the rows each dispatch hop
    delivered to it (from every rank's routing), and the ep bytes and calls of a step in each mode and
    without recompute."""
    cfg = dataclasses.replace(MOE_MODEL, capacity_factor=capacity)
    world = torch.distributed.get_world_size()
    mesh = ParallelMesh(ParallelDims(dp_shard=world, ep=world), "cpu")
    nodes = mesh.ep_node_groups(per_node) if dispatch == "hierarchical" else None
    rank, out = torch.distributed.get_rank(), {}
    for mode in ("none", "op", "op_rerun"):
        model, comm, rows, picks = build_model(cfg, seed=0), Comm(), [], []
        apply_expert_parallel(model, comm, mesh.group("ep"), dispatch, nodes=nodes)
        for block in model.layers.values():
            block.moe.experts.register_forward_pre_hook(
                lambda _m, a, r=rows: r.append(a[0].shape[:-1].numel())
            )
            block.moe.router.register_forward_hook(lambda _m, _a, o, p=picks: p.append(o[1]))
        with comm.recording() as rec:
            if mode != "none":
                keep = mode == "op"
                out[f"kept_{mode}"] = kept_bytes(cfg, "matmuls", model=model, seed=rank, keep_dispatch=keep)
            else:
                tokens = torch.randint(
                    0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank)
                )
                logits, aux = model(tokens[:, :-1], return_aux=True)
                (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux).backward()
        out[mode] = tuple(
            sum(f(g) for g in ("ep", "ep_inter", "ep_intra"))
            for f in (rec.stats.total_bytes, rec.stats.total_calls)
        )
        out["rows"] = rows[: cfg.n_layers]  # the forward's (the rerun's come after)
        if mode == "op":  # (the routing is the same in every mode: one model seed, one batch)
            everyone = [None] * world
            torch.distributed.all_gather_object(everyone, picks[: cfg.n_layers])
            local = cfg.n_experts // world
            out["delivered"] = [
                delivered_rows([p[layer] for p in everyone], rank, per_node, local)
                for layer in range(cfg.n_layers)
            ]
    mesh.close()
    return out


@pytest.mark.parametrize(
    "dispatch, capacity, world",
    [
        ("alltoall", 0.0, 2),
        ("alltoall", 1.5, 2),
        ("allgather", 0.0, 2),
        ("dedup", 0.0, 2),
        ("hierarchical", 0.0, 4),
    ],
)
def test_expert_parallel_rerun_takes_the_dispatch_from_the_store(workers, dispatch, capacity, world):
    """Under ep, the op rerun sends nothing again: a step moves the ep bytes and calls of the same step
    without recompute. With op_recompute_dispatch = "rerun" it sends the forward's dispatch once more
    (its count table, rows, gates and what else it carries: DISPATCH_CALLS per layer and hop) and keeps
    none of it. What each block keeps is the formula's either way, to the byte, given the rows each
    rank's experts processed and the rows each hop delivered to it, counted from every rank's routing
    (the hierarchical dispatch over 2 "nodes" of 2 ranks)."""
    cfg = dataclasses.replace(MOE_MODEL, capacity_factor=capacity)
    per_node = 2
    for rank in workers(world).run(kept_bytes_over_ep, dispatch, capacity, per_node):
        assert rank["op"] == rank["none"], rank
        (rerun_bytes, rerun_calls), (once_bytes, once_calls) = rank["op_rerun"], rank["none"]
        assert rerun_calls - once_calls == DISPATCH_CALLS[dispatch, capacity] * cfg.n_layers, rank
        assert rerun_bytes > once_bytes
        for mode, keeps in (("op", True), ("op_rerun", False)):
            want = [
                layer_activation_bytes(
                    cfg,
                    2,
                    32,
                    recompute="op",
                    ep=world,
                    ep_dispatch=dispatch,
                    kept=rows,
                    assignments=rows,
                    pairs=pairs,
                    crossed=crossed,
                    ep_per_node=per_node if dispatch == "hierarchical" else 0,
                    op_keeps_dispatch=keeps,
                )  # fmt: skip
                for rows, (pairs, crossed) in zip(rank["rows"], rank["delivered"], strict=True)
            ]
            assert rank[f"kept_{mode}"] == want, (mode, rank)


def kept_bytes_over_tp(model: str) -> dict:
    """On each of 2 tp ranks under sequence parallel: what op recompute keeps per block, and the tp bytes
    and calls of a forward and backward with op recompute and without."""
    cfg = MODELS[model]
    mesh, out = ParallelMesh(ParallelDims(tp=2), "cpu"), {}
    for mode in ("none", "op"):
        parallel, comm = build_model(cfg, seed=0), Comm()
        apply_tensor_parallel(parallel, comm, mesh.group("tp"), sequence_parallel=True)
        with comm.recording() as rec:
            if mode == "op":
                out["kept"] = kept_bytes(cfg, "matmuls", model=parallel, sp=2)
            else:
                logits, aux = parallel(torch.randint(0, cfg.vocab_size, (2, 32)), return_aux=True)
                (logits.float().square().mean() + aux).backward()
        out[mode] = (rec.stats.total_bytes("tp"), rec.stats.total_calls("tp"))
    mesh.close()
    return out


@pytest.mark.parametrize("model", ["dense", "moe", "mla_moe"])
def test_sequence_parallel_rerun_takes_the_attentions_reduce_scatter_from_the_store(workers, model):
    """Under tp 2 with sp, the op rerun gathers each region's input again (as a backward without
    recompute regathers it) but does not reduce-scatter the attention's output again: it is kept, T·h/tp
    per layer. A step moves the tp bytes and calls of the same step without recompute, and each block
    keeps the formula's bytes."""
    cfg = MODELS[model]
    routed = 2 * 32 * cfg.top_k if cfg.is_moe else None
    want = layer_activation_bytes(cfg, 2, 32, recompute="op", tp=2, sp=True, kept=routed, assignments=routed)
    for rank in workers(2).run(kept_bytes_over_tp, model):
        assert rank["op"] == rank["none"], rank
        assert rank["kept"] == [want] * cfg.n_layers, rank


# Forward dispatch collectives per MoE layer: the count table, rows and gates (dedup: and the chosen
# mask); a capacity's two even all-to-alls; the all-gather dispatch's tokens, gates, ids and mask.
DISPATCH_CALLS = {
    ("alltoall", 0.0): 3,
    ("alltoall", 1.5): 2,
    ("allgather", 0.0): 4,
    ("dedup", 0.0): 4,
    ("hierarchical", 0.0): 8,  # the dedup's four on each hop
}


@pytest.mark.parametrize("model", ["moe", "mla_moe"])
def test_the_rerun_stops_before_the_experts_down_projection(monkeypatch, model):
    """The op policy does not keep the routed experts' down-projection output: nothing after it saves a
    tensor (the gates are folded in before it, models/moe.py), so backward's rerun of each block stops
    before it and the down-projection runs once per layer, in forward only."""
    finished = []
    down = GroupedExperts.down

    def counted(self, h, counts_E):
        out = down(self, h, counts_E)
        finished.append(torch.is_grad_enabled())
        return out

    monkeypatch.setattr(GroupedExperts, "down", counted)
    cfg = MODELS[model]
    kept_bytes(cfg, "matmuls")  # (one forward and backward)
    assert len(finished) == cfg.n_layers


def test_op_recompute_keeps_between_selective_and_full():
    cfg = load_config(None, TINY).model
    f = lambda **kw: layer_activation_bytes(cfg, 4, 256, **kw)  # noqa: E731
    assert f(recompute="full") < f(recompute="op", op_saves="every_other_matmul") < f(recompute="op") < f()


def test_bad_policy_is_refused():
    with pytest.raises(ConfigError, match="op_recompute_saves"):
        check(load_config(None, [*TINY, *OP, "--training.op_recompute_saves=sometimes"]))
    with pytest.raises(ConfigError, match="model.kv_lora_rank = 0"):
        check(load_config(None, [*TINY, *OP, "--training.op_recompute_saves=matmuls_but_mla_up"]))


def test_planner_prices_op_recompute_between_none_and_selective():
    """Llama 3 8B at 8k tokens on 8 H100s (ZeRO-3): op recompute keeps less than selective and reruns
    less (no attention core); full keeps least and reruns most. (Under tensor parallel the row-parallel
    projections' outputs are partial sums of the whole width on every rank, which op keeps: there it can
    keep more than selective, and the planner counts that too.)"""
    cfg = load_config(None, ["--model.name=llama3-8b", "--training.seq_len=8192", "--training.global_batch=8",
                             "--training.dtype=bf16"])  # fmt: skip
    cluster = Cluster(accelerator("h100"), 8)
    results = {}
    for mode in ("none", "op", "selective", "full"):
        layout = Layout(dp_shard=8, zero=3, micro_batch=1, recompute=mode)
        results[mode] = estimate(layout.apply(cfg), cluster)
    memory = [results[m].memory_bytes_per_gpu for m in ("full", "op", "selective", "none")]
    time = [results[m].step_time_s for m in ("none", "op", "selective", "full")]
    assert memory == sorted(memory) and time == sorted(time), (memory, time)


CALL = ("all_to_all", "ep", (3,), 0, 0)


def test_a_rerun_that_strays_from_its_forward_is_refused():
    """The store replays in issue order: a rerun that asks for more reusable collectives than its forward
    kept, or for another call, or finds a kept output changed in place since, raises instead of
    replaying wrong values."""
    store, sent = kept_outputs.KeptOutputs(), []

    def collective() -> torch.Tensor:
        sent.append(1)
        return torch.ones(3)

    with kept_outputs.keeping(store), kept_outputs.reusable("dispatch"):
        out = kept_outputs.kept_or_issued(CALL, collective)
    assert kept_outputs.kept_or_issued(CALL, collective) is not out and len(sent) == 2  # outside: issued
    with kept_outputs.replaying(store), kept_outputs.reusable("dispatch"):
        assert torch.equal(kept_outputs.kept_or_issued(CALL, collective), out) and len(sent) == 2
        with pytest.raises(RuntimeError, match="more reusable collectives"):
            kept_outputs.kept_or_issued(CALL, collective)
    with (
        kept_outputs.replaying(store),
        kept_outputs.reusable("dispatch"),
        pytest.raises(RuntimeError, match="another path"),
    ):
        kept_outputs.kept_or_issued(("all_gather", "ep", (3,), 0), collective)
    out.add_(1)
    with (
        kept_outputs.replaying(store),
        kept_outputs.reusable("dispatch"),
        pytest.raises(RuntimeError, match="changed in place"),
    ):
        kept_outputs.kept_or_issued(CALL, collective)


def test_a_store_keeps_only_its_kinds():
    """A store made without "dispatch" (op_recompute_dispatch = "rerun") lets the dispatch's collectives
    through, in forward and in the rerun alike, and still keeps tensor parallel's."""
    store, sent = kept_outputs.KeptOutputs(frozenset({"tp"})), []

    def collective() -> torch.Tensor:
        sent.append(1)
        return torch.ones(3)

    for context in (kept_outputs.keeping, kept_outputs.replaying):
        with context(store), kept_outputs.reusable("dispatch"):
            kept_outputs.kept_or_issued(CALL, collective)
    with kept_outputs.keeping(store), kept_outputs.reusable("tp"):
        kept = kept_outputs.kept_or_issued(CALL, collective)
    with kept_outputs.replaying(store), kept_outputs.reusable("tp"):
        assert kept_outputs.kept_or_issued(CALL, collective) is not kept
    assert len(sent) == 3 and len(store.outputs) == 1
