"""Tensor and sequence parallel (and recompute, and tp x data parallel) against the single-device run:
losses over 6 steps and step-1 gradients gathered back to logical shape (tolerances in parity.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtron import hf
from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.rules.checks import load_config
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    comm_by_op,
    reference,
    ring,
    run_layout,
    train_rows,
)
from meshtron.testing.tiny import MOE, QWEN2_MOE_SHARED, TINY, save_tiny_hf_model

CASES = {
    # name: (world, model overrides, parallel overrides)
    "tp2": (2, [], ["--parallel.tp=2"]),
    "tp2_sp": (2, [], ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_kv_replicated": (4, [], ["--parallel.tp=4"]),  # 2 kv heads on 4 ranks
    "tp4_sp": (4, [], ["--parallel.tp=4", "--parallel.sp=true"]),
    "tp2_mqa": (2, ["--model.n_kv_heads=1"], ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_odd_vocab": (4, ["--model.vocab_size=301"], ["--parallel.tp=4", "--parallel.sp=true"]),
    "tp2_tied": (2, ["--model.tie_embeddings=true", "--model.vocab_size=301"], ["--parallel.tp=2"]),
    "tp2_qk_norm_bias": (2, ["--model.qk_norm=true", "--model.qkv_bias=true"], ["--parallel.tp=2"]),
    "tp2_moe_sp": (2, MOE, ["--parallel.tp=2", "--parallel.sp=true"]),
    "tp4_moe": (4, MOE, ["--parallel.tp=4"]),
    "tp2_x_fsdp2": (
        4,
        [],
        ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=2"],
    ),
    "tp2_sp_x_ddp2": (
        4,
        [],
        [
            "--parallel.tp=2",
            "--parallel.sp=true",
            "--parallel.dp_replicate=2",
            "--parallel.dp_shard=1",
            "--training.micro_batch=4",
        ],
    ),
    "tp2_sp_full_recompute": (2, [], ["--parallel.tp=2", "--parallel.sp=true", "--training.recompute=full"]),
    "tp2_selective_recompute": (2, [], ["--parallel.tp=2", "--training.recompute=selective"]),
    "fsdp2_full_recompute": (
        2,
        [],
        ["--parallel.dp_shard=2", "--training.recompute=full", "--training.micro_batch=4"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_device(workers, case):
    world, model, parallel = CASES[case]
    micro = [] if any("micro_batch" in p for p in parallel) else ["--training.micro_batch=8"]
    results = workers(world).run(run_layout, [*TINY, *model, *parallel, *micro])
    assert_parity(results[0], reference(workers(1), model))
    for other in results[1:]:
        assert [r["loss"] for r in other["rows"]] == [r["loss"] for r in results[0]["rows"]]


def tp_comm_by_op(overrides: list[str]) -> dict:
    """Bytes per collective on the tp group of one forward + backward (no clipping)."""
    return comm_by_op(overrides, ("tp",), ("all_reduce", "all_gather", "reduce_scatter"))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sp_move_the_reference_volume(workers, tp):
    """docs/theory.md#communication-volume: per layer per micro-batch 2 all-reduces forward and 2 backward
    of b·s·h elements; sequence parallel replaces each by an all-gather + reduce-scatter of the same total
    volume, and gathers each region's input again in backward (Megatron's sequence parallel)."""
    base = [*TINY, f"--parallel.tp={tp}", "--training.micro_batch=8", "--model.n_kv_heads=4"]
    plain = workers(tp).run(tp_comm_by_op, base)[0]
    with_sp = workers(tp).run(tp_comm_by_op, [*base, "--parallel.sp=true"])[0]
    cfg = load_config(None, base)
    b, s, h, layers = cfg.training.micro_batch, cfg.training.seq_len, cfg.model.dim, cfg.model.n_layers
    all_reduce = 2 * b * s * h * 4 * ring(tp)  # bytes per all-reduce of one activation
    per_layer = 4 * all_reduce
    # Around the layers: the embedding's reduction forward and the head's input all-reduce backward (one
    # activation each), and the vocab-parallel loss's three all-reduces of one number per token.
    extras = 2 * all_reduce + 3 * 2 * b * s * 4 * ring(tp)
    expected = layers * per_layer + extras
    print(f"tp={tp}: counted {plain} / with sp {with_sp}; expected {expected:.0f} B")
    assert sum(plain.values()) == expected
    assert plain["all_gather"] == plain["reduce_scatter"] == 0
    # With sp, only the loss's per-token numbers and the norm weights' gradient sums remain all-reduces.
    norm_grads = (2 * layers + 1) * 2 * h * 4 * ring(tp)
    assert with_sp["all_reduce"] == 3 * 2 * b * s * 4 * ring(tp) + norm_grads
    # Each region's input is gathered again in backward (2 per layer and the head's): half an all-reduce.
    regathers = (2 * layers + 1) * all_reduce / 2
    assert with_sp["all_gather"] == with_sp["reduce_scatter"] + regathers
    assert sum(with_sp.values()) - norm_grads - regathers == expected


def tp_logits_from_hf(path: str, sequence_parallel: bool) -> torch.Tensor:
    """A Hugging Face checkpoint loaded, sharded over tp, run; the vocab-parallel logits gathered back."""
    model = hf.load(path)
    comm = Comm()
    mesh = ParallelMesh(ParallelDims(tp=torch.distributed.get_world_size()), "cpu")
    tp = mesh.group("tp")
    apply_tensor_parallel(model, comm, tp, sequence_parallel)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        local = model(ids)
    logits = comm.all_gather_tensor(local.contiguous(), tp, dim=-1)[..., : model.cfg.vocab_size]
    mesh.close()
    return logits


HF_TP_CASES = {
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama_mqa_tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2_bias": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3_qk_norm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=10)),
    "qwen2_moe_shared": QWEN2_MOE_SHARED,
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("case", list(HF_TP_CASES))
def test_hugging_face_checkpoints_load_into_tensor_parallel_shards(
    workers, tmp_path, case, sequence_parallel
):
    reference_model = save_tiny_hf_model(*HF_TP_CASES[case], str(tmp_path))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference_model(input_ids=ids).logits
    for logits in workers(2).run(tp_logits_from_hf, str(tmp_path), sequence_parallel):
        assert (logits - expected).abs().max() <= 1e-4


def test_checkpoint_written_under_tensor_parallel_resumes_on_other_layouts(workers, tmp_path):
    """Save under tp 2 + sp x ZeRO-3 2 with a vocabulary (301) that tp pads, MoE included; resume on one
    device, under tp 4 (other cuts of every split dim) and under pp 2 x tp 2: each continues as the
    uninterrupted single-device run does."""
    base = [*TINY, *MOE, "--model.vocab_size=301", "--training.steps=6", "--training.micro_batch=2"]
    saving = ["--checkpoint.every=3", "--checkpoint.keep=1"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    saved_by = ["--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_shard=2", "--parallel.zero=3"]
    first = [*base, *saving, *saved_by, "--training.steps=3", f"--run.dir={tmp_path / 'first'}"]
    assert [r["step"] for r in workers(4).run(train_rows, first)[0]] == [1, 2, 3]
    for name, world, layout in [
        ("single", 1, ["--parallel.dp_shard=1"]),
        ("tp4", 4, ["--parallel.tp=4", "--parallel.dp_shard=1"]),
        ("pp2_tp2", 4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=1"]),
    ]:
        shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / name / "checkpoints")
        resume = [*base, *saving, *layout, "--checkpoint.resume=true", f"--run.dir={tmp_path / name}"]
        rows = workers(world).run(train_rows, resume)[0]
        assert_losses_match(rows, straight[3:])
