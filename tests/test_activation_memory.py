"""Bytes each layer keeps for backward (measured with saved-tensor hooks) against the per-tensor formula
of meshtron.plan.memory (Korthikanti et al.'s accounting applied to this block, fp32; docs/theory.md):
exactly, for no parallelism, tp, tp + sp and each recompute mode, so that a recompute mode that saves
nothing (selective keeps all but the attention's log-sum-exp) fails. The paper's own 16-bit GPT figure
is printed too. MoE layers on one device, under tp + sp, etp = 1 and ep (both dispatches), with the
routing the tiny router really chose plugged into the formula; the embedding, rotary tables, head and
loss, and with them the whole model's total."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.saved_gathers import recording_saves
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import ModelConfig
from meshtron.models.llama import build_model
from meshtron.models.loss import cross_entropy_per_token
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.context_latent import apply_latent_exchange
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from meshtron.plan.memory import (
    balanced_assignments,
    embedding_activation_elements,
    head_activation_bytes,
    korthikanti_bytes,
    layer_activation_bytes,
    layer_activation_elements,
    moe_layer_activation_elements,
    rotary_table_elements,
)
from meshtron.rules.checks import load_config
from meshtron.testing.parity import mesh_for
from meshtron.testing.tiny import MOE

BATCH, SEQ = 2, 64
MODEL = ["--model.name=tiny", "--model.n_layers=2", "--model.vocab_size=512"]


def saved_bytes_of_second_layer(
    tp: int,
    sp: bool,
    recompute: str,
    cp: int = 1,
    cp_impl: str = "ring",
    kv_heads: int = 2,
    model_keys: tuple[str, ...] = tuple(MODEL),
    exchange: str = "kv",
) -> int:
    """Storages (not parameters) that block 1 saves for backward and block 0 does not: shared tensors
    such as the rotary tables count for the model, not for a layer. Under cp, this rank's tokens."""
    overrides = [
        *model_keys,
        f"--model.n_kv_heads={kv_heads}",
        f"--parallel.cp={cp}",
        f"--parallel.cp_impl={cp_impl}",
        f"--parallel.tp={tp}",
        f"--parallel.sp={str(sp).lower()}",
    ]
    cfg = load_config(None, [*overrides, f"--training.seq_len={SEQ}"])
    model = build_model(cfg.model, seed=0)
    mesh = mesh_for(ParallelDims(cp=cp, tp=tp)) if tp * cp > 1 else None
    if tp > 1:
        apply_tensor_parallel(model, Comm(), mesh.group("tp"), sp)
    layout = (
        apply_context_parallel(model, Comm(), mesh.group("cp"), cfg.parallel.cp_impl, cfg.training.seq_len)
        if cp > 1
        else None
    )
    if exchange == "latent":
        apply_latent_exchange(model, Comm(), mesh.group("cp"), cfg.parallel.cp_impl)
    apply_recompute(model, recompute)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: list[dict[int, int]] = [{}, {}]
    current = {"block": None}

    def record(t: torch.Tensor) -> None:
        if current["block"] is not None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[current["block"]][storage.data_ptr()] = storage.nbytes()

    for index in (0, 1):
        block = model.layers[str(index)]
        block.register_forward_pre_hook(lambda *_a, i=index: current.update(block=i))
        block.register_forward_hook(lambda *_a: current.update(block=None))
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ) if layout is None else layout.positions(mesh.group("cp").rank)
    with recording_saves(record):
        model(tokens[:, positions], positions.expand(BATCH, -1))
    return sum(n for ptr, n in saved[1].items() if ptr not in saved[0])


CASES = [
    (1, False, "none"),
    (1, False, "selective"),
    (1, False, "full"),
    (2, False, "none"),
    (2, True, "none"),
    (2, True, "selective"),
    (2, True, "full"),
    (2, False, "full"),
]


@pytest.mark.parametrize("tp, sp, recompute", CASES)
def test_saved_activations_match_the_formula(workers, tp, sp, recompute):
    measured = (
        workers(tp).run(saved_bytes_of_second_layer, tp, sp, recompute)
        if tp > 1
        else [saved_bytes_of_second_layer(1, False, recompute)]
    )
    cfg = load_config(None, MODEL).model
    expected = layer_activation_bytes(cfg, BATCH, SEQ, tp=tp, sp=sp, recompute=recompute)
    paper = korthikanti_bytes(cfg, BATCH, SEQ, tp=tp, sp=sp, recompute=recompute)
    print(
        f"tp={tp} sp={sp} recompute={recompute}: measured {measured} B/layer/rank, formula {expected} B "
        f"(fp32); Korthikanti 16-bit GPT layer {paper:.0f} B"
    )
    assert measured == [expected] * len(measured)


CP_CASES = [
    # cp, cp_impl, tp, sp, recompute, kv heads
    (2, "ring", 1, False, "none", 2),
    (4, "ring", 1, False, "none", 2),
    (2, "allgather", 1, False, "none", 2),
    (2, "alltoall", 1, False, "none", 2),
    (4, "alltoall", 1, False, "none", 2),  # 2 kv heads replicated to 4
    (2, "ring", 1, False, "selective", 2),
    (2, "ring", 1, False, "full", 2),
    (2, "ring", 2, True, "none", 2),
    (2, "alltoall", 2, False, "none", 4),
]


@pytest.mark.parametrize("cp, impl, tp, sp, recompute, kv_heads", CP_CASES)
def test_context_parallel_keeps_the_formula_share(workers, cp, impl, tp, sp, recompute, kv_heads):
    """Every rank of cp keeps the formula's bytes for its s/cp tokens: attention memory falls as 1/cp
    (the exchanged K/V blocks are not kept), except for Ulysses' replicated key/value heads."""
    measured = workers(cp * tp).run(saved_bytes_of_second_layer, tp, sp, recompute, cp, impl, kv_heads)
    cfg = load_config(None, [*MODEL, f"--model.n_kv_heads={kv_heads}"]).model
    ulysses = cp if impl == "alltoall" else 1
    expected = layer_activation_bytes(
        cfg, BATCH, SEQ, tp=tp, sp=sp, recompute=recompute, cp=cp, ulysses=ulysses
    )
    print(f"cp={cp} {impl} tp={tp} sp={sp} {recompute}: measured {measured}, formula {expected} B/layer/rank")
    assert measured == [expected] * len(measured)


# Multi-head latent attention (dense): latents whole or sequence-sharded, q and k of N + R dims and
# narrower values (padded for SDPA's kernel), each cp exchange's own saves.
MLA = ("--model.name=tiny-deepseek", "--model.n_experts=0", "--model.n_layers=2", "--model.vocab_size=512")
MLA_CASES = {
    # name: (tp, sp, recompute, cp, cp_impl, exchange, extra model keys)
    "one_device": (1, False, "none", 1, "ring", "kv", ()),
    "selective_full_q": (1, False, "selective", 1, "ring", "kv", ("--model.q_lora_rank=0",)),
    "full": (1, False, "full", 1, "ring", "kv", ()),
    "tp2": (2, False, "none", 1, "ring", "kv", ()),
    "tp2_sp": (2, True, "none", 1, "ring", "kv", ()),
    "tp2_sp_selective_full_q": (2, True, "selective", 1, "ring", "kv", ("--model.q_lora_rank=0",)),
    "cp2_ring_kv": (1, False, "none", 2, "ring", "kv", ()),
    "cp2_alltoall": (1, False, "none", 2, "alltoall", "kv", ()),
    "cp2_ring_latent": (1, False, "none", 2, "ring", "latent", ()),
    "cp2_allgather_latent_selective": (1, False, "selective", 2, "allgather", "latent", ()),
}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_latent_attention_matches_the_formula(workers, case):
    tp, sp, recompute, cp, impl, exchange, extra = MLA_CASES[case]
    keys = (*MLA, *extra)
    run = partial(saved_bytes_of_second_layer, model_keys=keys, exchange=exchange, kv_heads=0)
    measured = (
        workers(tp * cp).run(run, tp, sp, recompute, cp, impl) if tp * cp > 1 else [run(1, False, recompute)]
    )
    cfg = load_config(None, list(keys)).model
    expected = layer_activation_bytes(
        cfg,
        BATCH,
        SEQ,
        tp=tp,
        sp=sp,
        recompute=recompute,
        cp=cp,
        ulysses=cp if impl == "alltoall" else 1,
        exchange=exchange,
    )
    assert measured == [expected] * len(measured)


def test_parallelism_and_recompute_reduce_memory_as_the_paper_says():
    """The orderings the paper predicts, from the formula that the test above ties to measurements."""
    cfg = load_config(None, MODEL).model
    f = lambda **kw: layer_activation_bytes(cfg, BATCH, SEQ, **kw)  # noqa: E731
    assert f(tp=2) < f(tp=1)
    assert f(tp=2, sp=True) < f(tp=2)
    assert f(recompute="full") < f(recompute="selective") < f()
    assert f(tp=2, sp=True, recompute="full") == f(recompute="full") // 2
    assert f(cp=4) == f() // 4 and f(cp=2, tp=2, sp=True) < f(tp=2, sp=True)


def saved_bytes_by_part(
    overrides: list[str], tp: int = 1, sp: bool = False, recompute: str = "none", ep: int = 1, etp: int = 0
) -> dict:
    """One forward and loss on this rank: bytes of the storages (not parameters, nor the batch's tokens
    and targets) saved by the embedding, by block 1 and not block 0, by the head and loss, by all of it;
    and each MoE layer's routing: `kept` (this rank's assignments it sorts and combines) and
    `assignments` (the rows its experts process)."""
    cfg = load_config(
        None, [*overrides, f"--training.seq_len={SEQ}", f"--parallel.tp={tp}", f"--parallel.ep={ep}"]
    )
    model = build_model(cfg.model, seed=0)
    dims = ParallelDims(tp=tp, dp_shard=ep, ep=ep, etp=etp)  # (etp = 1: ep over the tp ranks first)
    mesh = mesh_for(dims) if tp * ep > 1 else None
    plan = apply_tensor_parallel(model, Comm(), mesh.group("tp"), sp, etp in (0, tp)) if tp > 1 else None
    comm, pairs, kept = Comm(), [], []
    if dims.experts_apart:
        shares = mesh.group("tp") if etp == 1 and tp > 1 else None
        apply_expert_parallel(model, comm, mesh.group("ep"), cfg.parallel.ep_dispatch, shares)
        exchange = comm.all_to_all_v

        def counted_exchange(x, group, output_splits, input_splits):
            if x.is_floating_point() and x.shape[-1] == cfg.model.dim:  # tokens there, partial sums back
                pairs.append(x.shape[0])
            return exchange(x, group, output_splits, input_splits)

        comm.all_to_all_v = counted_exchange
    moe_layers = [block.moe for block in model.layers.values() if block.moe is not None]
    if moe_layers:  # what each layer's dispatch sorts and combines: its share of the kept assignments
        holder = moe_layers[0].dispatch if hasattr(moe_layers[0].dispatch, "inner") else None
        inner = holder.inner if holder is not None else moe_layers[0].dispatch

        def counted_dispatch(moe, x_TD, routing):
            kept.append(int(routing.keep_Tk.sum()))
            return inner(moe, x_TD, routing)

        if holder is not None:
            holder.inner = counted_dispatch
        else:
            for moe in moe_layers:
                moe.dispatch = counted_dispatch
    apply_recompute(model, recompute)
    rank = torch.distributed.get_rank() if mesh is not None else 0
    generator = torch.Generator().manual_seed(rank // tp)  # the ep ranks route different tokens
    tokens, targets = torch.randint(0, cfg.model.vocab_size, (2, BATCH, SEQ), generator=generator)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), tokens, targets)}
    saved: dict[str, dict[int, int]] = {}
    part = {"now": "embedding"}
    alive = []  # a storage freed early (a discarded branch) must not lend its address to a later one

    def record(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved.setdefault(part["now"], {})[storage.data_ptr()] = storage.nbytes()
            alive.append(t)

    rows: list[int] = []
    for index, block in model.layers.items():
        block.register_forward_pre_hook(lambda *_a, i=index: part.update(now=i))
        block.register_forward_hook(lambda *_a: part.update(now="head"))
        if block.moe is not None:
            block.moe.experts.register_forward_pre_hook(
                lambda _m, args: rows.append(args[0].shape[:-1].numel())
            )
    with recording_saves(record):
        logits, aux = model(tokens, return_aux=True)  # the MoE losses are back-propagated too
        ce = (
            cross_entropy_per_token
            if plan is None
            else partial(vocab_parallel_cross_entropy, plan=plan, comm=Comm())
        )
        ce(logits, targets).sum() + aux
    every = {ptr: n for storages in saved.values() for ptr, n in storages.items()}
    return {
        "embedding": sum(saved.get("embedding", {}).values()),
        "layer": sum(n for ptr, n in saved["1"].items() if ptr not in saved["0"]),
        "head": sum(saved["head"].values()),
        "total": sum(every.values()),
        "assignments": rows,
        "kept": kept,
        "pairs": pairs[::2],  # the dedup dispatch's (token, rank) rows sent, per MoE layer
    }


def run_on_ranks(workers, world: int, *args, **kwargs) -> list[dict]:
    return (
        workers(world).run(saved_bytes_by_part, *args, **kwargs)
        if world > 1
        else [saved_bytes_by_part(*args, **kwargs)]
    )


def model_bytes(cfg: ModelConfig, measured: dict, tp: int, sp: bool, **layer_kwargs) -> tuple[int, int, int]:
    """(embedding, head, whole model) bytes by the formulas, each MoE layer with its measured routing."""
    embedding = embedding_activation_elements(cfg, BATCH, SEQ, tp=tp).bytes()
    head = head_activation_bytes(cfg, BATCH, SEQ, tp=tp, sp=sp)
    layers = 0
    for layer in range(cfg.n_layers):
        routing = {}
        if cfg.is_moe_layer(layer):
            moe_index = sum(cfg.is_moe_layer(i) for i in range(layer))
            routing = dict(kept=measured["kept"][moe_index], assignments=measured["assignments"][moe_index])
            if layer_kwargs.get("ep_dispatch") == "dedup":
                routing["pairs"] = measured["pairs"][moe_index]
        layers += layer_activation_bytes(
            cfg, BATCH, SEQ, tp=tp, sp=sp, layer=layer, **layer_kwargs, **routing
        )
    rotary = 4 * rotary_table_elements(cfg, BATCH, SEQ)  # fp32
    return embedding, head, embedding + rotary + layers + head


# Mixed routing options: sigmoid scores without renormalised top-k, per-sequence balance, no shared expert,
# capacity 1 (the tiny router's uneven choices drop assignments).
MOE_VARIANT = [
    "--model.router=sigmoid",
    "--model.router_norm_topk=false",
    "--model.balance_loss=sequence",
    "--model.n_shared_experts=0",
    "--model.capacity_factor=1.0",
]
MOE_CASES = [
    # tp, sp, ep, dispatch, etp, recompute, model overrides
    (1, False, 1, "alltoall", 0, "none", []),
    (1, False, 1, "alltoall", 0, "selective", []),
    (1, False, 1, "alltoall", 0, "full", []),
    (1, False, 1, "alltoall", 0, "none", MOE_VARIANT),
    (2, True, 1, "alltoall", 0, "none", []),
    (2, True, 1, "alltoall", 0, "selective", []),
    (2, True, 1, "alltoall", 0, "full", []),
    (2, False, 1, "alltoall", 1, "none", []),
    (1, False, 2, "alltoall", 0, "none", []),
    (1, False, 2, "alltoall", 0, "selective", []),
    (1, False, 2, "alltoall", 0, "full", []),
    (1, False, 2, "alltoall", 0, "none", MOE_VARIANT),
    (1, False, 2, "alltoall", 0, "selective", ["--model.capacity_factor=1.5"]),
    (1, False, 2, "allgather", 0, "none", []),
    (1, False, 2, "dedup", 0, "none", []),
    (1, False, 2, "dedup", 0, "selective", MOE_VARIANT),
    (2, False, 2, "dedup", 1, "none", []),
    # folded: ep over the tp ranks (whole experts, each tp rank sending its share), capacity slots too
    (2, True, 2, "alltoall", 1, "none", []),
    (2, False, 2, "alltoall", 1, "none", ["--model.capacity_factor=1.5"]),
]


@pytest.mark.parametrize("tp, sp, ep, dispatch, etp, recompute, extra", MOE_CASES)
def test_moe_layer_matches_the_formula_given_its_routing(
    workers, tp, sp, ep, dispatch, etp, recompute, extra
):
    """An MoE block, and the whole model with its two ends, on every rank: exactly the formula's bytes once
    the measured routing (assignments kept and processed per rank) replaces the balanced default."""
    overrides = [*MOE, *extra, f"--parallel.ep_dispatch={dispatch}"]
    measured = run_on_ranks(workers, tp * ep, overrides, tp, sp, recompute, ep, etp)
    cfg = load_config(None, overrides).model
    kw = dict(recompute=recompute, ep=ep, ep_dispatch=dispatch, expert_tp=etp in (0, tp))
    for rank in measured:
        routing = dict(kept=rank["kept"][1], assignments=rank["assignments"][1])
        if dispatch == "dedup":
            routing["pairs"] = rank["pairs"][1]
        layer = layer_activation_bytes(cfg, BATCH, SEQ, tp=tp, sp=sp, layer=1, **kw, **routing)
        _, head, total = model_bytes(cfg, rank, tp, sp, **kw)
        print(
            f"tp={tp} sp={sp} ep={ep} {dispatch} etp={etp} {recompute}: layer {rank['layer']} B "
            f"(formula {layer}), model {rank['total']} B (formula {total}); routing {routing}"
        )
        assert (rank["layer"], rank["total"]) == (layer, total)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_model_ends_match_the_formula(workers, tp, sp):
    """The embedding (nothing but the token ids on one device), the final norm, head and loss (the fp32
    log-probabilities or, vocab-parallel, this rank's softmax), and the whole dense model."""
    measured = run_on_ranks(workers, tp, MODEL, tp, sp)
    cfg = load_config(None, MODEL).model
    for rank in measured:
        embedding, head, total = model_bytes(cfg, rank, tp, sp)
        print(
            f"tp={tp} sp={sp}: embedding {rank['embedding']} B, head {rank['head']} B, all {rank['total']} B"
        )
        assert (rank["embedding"], rank["head"], rank["total"]) == (embedding, head, total)


def test_balanced_routing_is_the_default():
    """Without measured counts an MoE layer assumes every expert gets T·k/E assignments (capped by the
    capacity), and under ep each rank processes what it sends."""
    cfg = load_config(None, MOE).model
    tokens = BATCH * SEQ
    f = lambda **kw: moe_layer_activation_elements(cfg, BATCH, SEQ, **kw)  # noqa: E731
    assert f() == f(kept=tokens * cfg.top_k, assignments=tokens * cfg.top_k)
    assert f(ep=2) == f(ep=2, kept=tokens * cfg.top_k, assignments=tokens * cfg.top_k)
    assert f(tp=2, expert_tp=False) == f(tp=2, expert_tp=False, kept=tokens * cfg.top_k // 2)
    assert layer_activation_elements(cfg, BATCH, SEQ) == f().elements
    capped = load_config(None, [*MOE, "--model.capacity_factor=0.5"]).model
    assert balanced_assignments(capped, tokens) == tokens * cfg.top_k // 2
    # A dense layer of an MoE model (DeepSeek's first ones) counts as a dense model's layer.
    first_dense = load_config(None, [*MOE, "--model.dense_layers=[0]"]).model
    dense = load_config(None, [*MOE, "--model.n_experts=0"]).model
    assert layer_activation_elements(first_dense, BATCH, SEQ, layer=0) == layer_activation_elements(
        dense, BATCH, SEQ
    )
