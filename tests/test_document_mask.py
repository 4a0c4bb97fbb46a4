"""Per-document attention in packed windows (issue 32.1): a packed window's logits and loss equal those
of its documents run alone, each from position 0, and every layout (context parallel's four exchanges
included) matches the single-device run."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.data.dataset import prepare_data
from meshtron.models.attention import document_causal_mask
from meshtron.models.documents import DocumentMask, document_layout
from meshtron.models.llama import build_model
from meshtron.rules.checks import load_config
from meshtron.testing.parity import assert_losses_match, train_rows
from meshtron.testing.tiny import MOE, TINY, perturb

EOS = 256  # the byte tokenizer's end-of-document token


def test_layout_of_a_packed_window():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9]])
    positions, docs = document_layout(tokens, EOS)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]


@pytest.mark.parametrize("window", [0, 3])
def test_a_packed_window_computes_each_document_as_if_alone(window):
    cfg = load_config(None, [*TINY, f"--model.sliding_window={window}"]).model
    model = build_model(cfg, seed=0)
    perturb(model, 0)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 256, (n,), generator=generator) for n in (6, 9, 4)]
    documents = [torch.cat([d, torch.tensor([EOS])]) for d in documents[:2]] + [documents[2]]
    packed = torch.cat(documents)[None]
    positions, docs = DocumentMask(EOS).layout(packed, torch.arange(packed.shape[1])[None])
    with torch.no_grad():
        logits = model(packed, positions, docs_BS=docs)[0]
        alone = torch.cat([model(d[None])[0] for d in documents])
        plain = model(packed)[0]
    assert (logits - alone).abs().max() <= 1e-5
    assert (plain - alone).abs().max() > 1e-2  # without the mask the documents see each other
    targets = packed[0, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum")
    want = torch.nn.functional.cross_entropy(alone[:-1], targets, reduction="sum")
    assert abs(float(loss - want)) <= 1e-5 * float(want)


def test_no_sequence_by_sequence_mask_is_kept_for_backward():
    """On CPU the mask is applied tile by tile (models/blockwise_attention.py): what a layer saves for
    backward grows with S, not S², and attention's gradients equal SDPA's under the dense mask."""
    cfg = load_config(None, TINY).model
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))  # S = 40, not dim
    tokens[:, ::7] = EOS
    positions, docs = DocumentMask(EOS).layout(tokens, torch.arange(40).expand(2, -1))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        model(tokens, positions, docs_BS=docs)[0].sum().backward()
    assert len(shapes) > 10 and not [s for s in shapes if s[-2:] == (40, 40)]  # no [.., S, S] tensor
    q, k, v = (torch.randn(2, 4, 40, 8, requires_grad=True) for _ in range(3))
    attention = model.layers["0"].attention
    grads = []
    for attend in (attention.attend, lambda q, k, v, d: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_causal_mask(d)
    )):  # fmt: skip
        out = attend(q, k, v, docs)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for ours, dense in zip(*grads, strict=True):
        assert (ours - dense).abs().max() < 1e-5


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Many short documents, so that every 32-token window holds several."""
    tmp = tmp_path_factory.mktemp("docs")
    generator = torch.Generator().manual_seed(1)
    words = ["mesh", "rank", "shard", "pipe", "ring", "expert", "token", "step"]
    lines = []
    for _ in range(600):
        n = int(torch.randint(2, 7, (1,), generator=generator))
        picks = torch.randint(0, len(words), (n,), generator=generator).tolist()
        lines.append(json.dumps({"text": " ".join(words[i] for i in picks)}))
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_data([tmp / "docs.jsonl"], tmp / "prepared", tokenizer="byte")
    return tmp / "prepared"


LAYOUTS = {
    "dp2": (2, ["--parallel.dp_shard=2", "--training.micro_batch=2"]),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--training.micro_batch=2"]),
    "pp2_zero_bubble_selective": (
        2,
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=zero_bubble",
            "--training.micro_batch=2",
            "--training.recompute=selective",
        ],
    ),  # fmt: skip
    "dp2_full_recompute": (
        2,
        ["--parallel.dp_shard=2", "--training.recompute=full", "--training.micro_batch=4"],
    ),
    "compiled": (1, ["--training.compile=true"]),
    "cp2_ring_selective": (2, ["--parallel.cp=2", "--training.recompute=selective"]),
    "cp2_allgather": (2, ["--parallel.cp=2", "--parallel.cp_impl=allgather"]),
    "cp2_alltoall": (2, ["--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "cp4_hybrid": (4, ["--parallel.cp=4", "--parallel.cp_impl=hybrid", "--parallel.cp_ulysses=2"]),
    "cp2_pp2": (
        4,
        ["--parallel.cp=2", "--parallel.pp=2", "--training.micro_batch=2"],
    ),
}


@pytest.fixture(scope="module")
def one_device(workers, short_documents):
    base = [*TINY, f"--data.path={short_documents}", "--training.steps=3", "--run.sample_tokens=0"]
    masked = workers(1).run(train_rows, [*base, "--data.document_mask=true"])[0]
    plain = workers(1).run(train_rows, base)[0]
    assert abs(masked[0]["loss"] - plain[0]["loss"]) > 1e-3  # the mask changes what is computed
    return base, masked


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_one_device_with_documents(workers, one_device, layout):
    base, want = one_device
    world, overrides = LAYOUTS[layout]
    rows = workers(world).run(train_rows, [*base, "--data.document_mask=true", *overrides])[0]
    assert_losses_match(rows, want)


def test_a_sliding_window_over_context_parallel_ranks_with_documents(workers, short_documents):
    base = [
        *TINY,
        f"--data.path={short_documents}",
        "--data.document_mask=true",
        "--model.sliding_window=12",
        "--training.steps=2",
        "--run.sample_tokens=0",
    ]  # fmt: skip
    want = workers(1).run(train_rows, base)[0]
    for impl in ("ring", "allgather"):
        assert_losses_match(
            workers(2).run(train_rows, [*base, "--parallel.cp=2", f"--parallel.cp_impl={impl}"])[0], want
        )


def test_experts_over_two_ranks_match_one_device_with_documents(workers, short_documents):
    base = [
        *TINY,
        *MOE,
        f"--data.path={short_documents}",
        "--data.document_mask=true",
        "--training.steps=3",
        "--run.sample_tokens=0",
        "--training.micro_batch=2",
    ]  # fmt: skip  (the balance loss groups by micro-batch)
    want = workers(1).run(train_rows, base)[0]
    rows = workers(2).run(
        train_rows, [*base, "--parallel.ep=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]
    )[0]
    assert_losses_match(rows, want)
