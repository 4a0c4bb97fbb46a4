"""Bytes each layer keeps for backward (measured with saved-tensor hooks) against the per-tensor formula
of meshtron.plan.memory (Korthikanti et al.'s accounting applied to this block, fp32; docs/theory.md):
exactly, for no parallelism, tp, tp + sp and each recompute mode, so that a recompute mode that saves
nothing (selective keeps all but the attention's log-sum-exp) fails. The paper's own 16-bit GPT figure
is printed too."""

from __future__ import annotations

import pytest
import torch

from meshtron.comm import Comm
from meshtron.config import load_config
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import build_model
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.plan.memory import korthikanti_bytes, layer_activation_bytes

BATCH, SEQ = 2, 64
MODEL = ["--model.name=tiny", "--model.n_layers=2", "--model.vocab_size=512"]


def saved_bytes_of_second_layer(
    tp: int, sp: bool, recompute: str, cp: int = 1, cp_impl: str = "ring", kv_heads: int = 2
) -> int:
    """Storages (not parameters) that block 1 saves for backward and block 0 does not: shared tensors
    such as the rotary tables count for the model, not for a layer. Under cp, this rank's tokens."""
    overrides = [
        *MODEL,
        f"--model.n_kv_heads={kv_heads}",
        f"--parallel.cp={cp}",
        f"--parallel.cp_impl={cp_impl}",
        f"--parallel.tp={tp}",
        f"--parallel.sp={str(sp).lower()}",
    ]
    cfg = load_config(None, [*overrides, f"--training.seq_len={SEQ}"])
    model = build_model(cfg.model, seed=0)
    mesh = ParallelMesh(ParallelDims(cp=cp, tp=tp), "cpu") if tp * cp > 1 else None
    if tp > 1:
        apply_tensor_parallel(model, Comm(), mesh.group("tp"), sp)
    layout = apply_context_parallel(model, Comm(), mesh.group("cp"), cfg) if cp > 1 else None
    apply_recompute(model, recompute)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: list[dict[int, int]] = [{}, {}]
    current = {"block": None}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current["block"] is not None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[current["block"]][storage.data_ptr()] = storage.nbytes()
        return t

    for index in (0, 1):
        block = model.layers[str(index)]
        block.register_forward_pre_hook(lambda *_a, i=index: current.update(block=i))
        block.register_forward_hook(lambda *_a: current.update(block=None))
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ) if layout is None else layout.positions(mesh.group("cp").rank)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, positions], positions.expand(BATCH, -1))
    if mesh is not None:
        mesh.close()
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


def test_parallelism_and_recompute_reduce_memory_as_the_paper_says():
    """The orderings the paper predicts, from the formula that the test above ties to measurements."""
    cfg = load_config(None, MODEL).model
    f = lambda **kw: layer_activation_bytes(cfg, BATCH, SEQ, **kw)  # noqa: E731
    assert f(tp=2) < f(tp=1)
    assert f(tp=2, sp=True) < f(tp=2)
    assert f(recompute="full") < f(recompute="selective") < f()
    assert f(tp=2, sp=True, recompute="full") == f(recompute="full") // 2
    assert f(cp=4) == f() // 4 and f(cp=2, tp=2, sp=True) < f(tp=2, sp=True)
