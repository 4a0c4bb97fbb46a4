"""Context-parallel attention against the single-device attention, rank by rank: output, log-sum-exp,
dQ, dK, dV within 1e-5 (fp32) for every implementation at cp 2 and 4, with 1, 2 and n_heads key/value
heads, distinct K/V on every rank and a random upstream gradient (so a backward that reused a stale
K/V, or sent a dK/dV accumulator to the wrong rank, fails), with and without a document mask (and then
the ring steps skipped, counted exactly). Plus the zigzag map, the work balance and the merge's
robustness, which need no processes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.models.block_positions import Positions
from meshtron.models.blockwise_attention import (
    _FUSED,
    _FUSED_BACKWARD,
    _fused_parts,
    block_backward,
    block_forward,
    merge_,
)
from meshtron.models.documents import document_layout
from meshtron.parallel.context import ContextParallelAttention, RingPass, SequenceLayout, zigzag_positions
from meshtron.pictures.documents import documents_of, draw_documents, skipped_steps

TOL = 1e-5
B, H, S, D = 2, 4, 32, 8
# impl -> cp_ulysses (hybrid splits cp 4 as ring 2 x ulysses 2)
IMPLS = {"ring": 1, "allgather": 1, "alltoall": None, "hybrid": 2}


def packed_documents(seed: int) -> torch.Tensor:
    """Document ids [B, S] of windows packed with short documents (1 to 6 tokens, end token 0)."""
    tokens = torch.randint(1, 7, (B, S), generator=torch.Generator().manual_seed(seed))
    return document_layout(torch.where(tokens == 1, 0, tokens), 0)[1]


def allowed_mask(docs: torch.Tensor | None, window: int) -> torch.Tensor:
    """[B or 1, S, S]: which keys each query sees, causal (windowed, within documents)."""
    i = torch.arange(S)
    distance = i[:, None] - i[None, :]
    allowed = ((distance >= 0) & ((distance < window) if window else True))[None]
    return allowed if docs is None else allowed & (docs[:, :, None] == docs[:, None, :])


def reference_attention(q, k, v, dout, window: int, docs: torch.Tensor | None = None):
    """Single-device attention in fp64: output, log-sum-exp and the three gradients."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed_mask(docs, window)[:, None], float("-inf"))
    out = s.softmax(-1) @ vv
    lse = torch.logsumexp(s, -1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def expected_skips(docs: torch.Tensor, ring: int, rank: int) -> int:
    """Ring steps of `rank` in which none of its queries sees any of the visiting keys (from the dense
    mask: what a ring pass may skip whole)."""
    allowed, mine = allowed_mask(docs, 0), zigzag_positions(rank, ring, S)
    visiting = [zigzag_positions(j, ring, S) for j in range(ring)]
    return sum(not allowed[:, mine][:, :, theirs].any() for theirs in visiting)


def cp_attention_errors(world: int) -> dict[str, float]:
    """On every rank: the largest error of each (impl, kv heads, window, documents) case at cp = world;
    a ring's skipped steps that differ from the dense mask's count make the case's error infinite."""
    comm, errors = Comm(), {}
    cases = itertools.product(IMPLS, (1, 2, H), (0, 5), (False, True))
    for impl, kv_heads, window, with_docs in cases:
        ulysses = IMPLS[impl] if IMPLS[impl] is not None else world
        if impl == "hybrid" and world < 4:
            continue
        dims = ParallelDims(cp=world, cp_ulysses=ulysses if impl == "hybrid" else 1)
        mesh = ParallelMesh(dims, "cpu")
        cp = mesh.group("cp")
        parts = (mesh.group("cp_ring"), mesh.group("cp_ulysses")) if impl == "hybrid" else (cp, cp)
        ring = None if impl == "alltoall" else parts[0]
        uly = cp if impl == "alltoall" else parts[1] if impl == "hybrid" else None
        gen = torch.Generator().manual_seed(len(errors))
        q, dout = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
        k, v = (torch.randn(B, kv_heads, S, D, generator=gen) for _ in range(2))
        docs = packed_documents(len(errors)) if with_docs else None
        want = reference_attention(q, k, v, dout, window, docs)
        ring_degree = world // (ulysses if impl in ("alltoall", "hybrid") else 1)
        layout = SequenceLayout(S, ring_degree, world // ring_degree)
        mine = layout.positions(cp.rank)
        local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
        attention = ContextParallelAttention(comm, impl, ring, uly, window)
        out, lse = attention.with_lse(*local, docs_BS=docs)
        out.backward(dout[:, :, mine])
        got = [t.detach().double() for t in (out, lse, *(t.grad for t in local))]
        case = f"{impl}/kv{kv_heads}/w{window}" + ("/docs" if with_docs else "")
        errors[case] = max(float((g - w[:, :, mine]).abs().max()) for g, w in zip(got, want, strict=True))
        if isinstance(attention.inner, RingPass) and with_docs and window == 0:  # forward and backward
            skipped = 2 * expected_skips(docs, ring_degree, ring.rank)
            errors[case] += 0.0 if attention.inner.blocks_skipped == skipped else float("inf")
            errors[f"skipped/{case}"] = attention.inner.blocks_skipped
        mesh.close()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_every_implementation_matches_single_device_attention(workers, world):
    skipped = 0
    for rank, errors in enumerate(workers(world).run(cp_attention_errors, world)):
        skipped += sum(errors.pop(case) for case in [c for c in errors if c.startswith("skipped/")])
        assert len(errors) == (3 if world == 2 else 4) * 3 * 2 * 2
        bad = {case: err for case, err in errors.items() if not err <= TOL}
        assert not bad, f"rank {rank}: {bad}"
    # At cp 4 the documents (at most 6 tokens) cannot reach from a rank's first chunk to the queries
    # 8 positions on: those ring steps have nothing to compute, and were skipped (at cp 2 a step is
    # empty only when a document ends exactly at a chunk's edge).
    assert skipped > 0 or world == 2


def test_zigzag_map_round_trips_and_balances_work():
    for cp, ulysses in [(1, 1), (2, 1), (4, 1), (4, 2), (3, 1), (4, 4), (8, 2)]:
        layout = SequenceLayout(48, cp // ulysses, ulysses)
        held = torch.cat([layout.positions(r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(48))  # every token exactly once
        inverse = torch.argsort(held)
        assert torch.equal(held[inverse], torch.arange(48))
    # Causal attention work per rank: the area under the causal mask its queries cover, sum of (p + 1/2).
    for cp in (2, 4, 8):
        balanced = [float((zigzag_positions(r, cp, 64) + 0.5).sum()) for r in range(cp)]
        contiguous = [float((torch.arange(64).chunk(cp)[r] + 0.5).sum()) for r in range(cp)]
        assert len(set(balanced)) == 1
        assert contiguous[-1] / contiguous[0] == 2 * cp - 1


def test_merge_survives_far_apart_and_fully_masked_blocks():
    q = torch.randn(1, 2, 4, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    pos = torch.arange(4) + 10
    # Keys all in the future: every row fully masked.
    masked_out, masked_lse = block_forward(q, k, v, pos, torch.arange(6) + 100)
    assert torch.isneginf(masked_lse).all() and (masked_out == 0).all()
    out, lse = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
    merge_(out, lse, masked_out, masked_lse)  # -inf with -inf
    assert torch.isneginf(lse).all() and torch.isfinite(out).all()
    part, part_lse = block_forward(q * 30, k, v, pos, torch.arange(6))
    far_lse = part_lse + 90.0  # differ by far more than 80 from the next block
    merge_(out, lse, part, far_lse)
    merge_(out, lse, part, part_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.allclose(out, part, atol=1e-6)  # the far block dominates completely
    # An exact merge: two halves of the keys give the whole.
    whole, whole_lse = block_forward(q, k, v, pos, torch.arange(6))
    a, a_lse = block_forward(q, k[:, :, :3], v[:, :, :3], pos, torch.arange(3))
    b, b_lse = block_forward(q, k[:, :, 3:], v[:, :, 3:], pos, torch.arange(3, 6))
    merge_(a, a_lse, b, b_lse)
    assert torch.allclose(a, whole, atol=1e-6) and torch.allclose(a_lse, whole_lse, atol=1e-6)


def test_this_torch_has_the_fused_cpu_kernel():
    """The "fused" cases below test PyTorch's CPU flash-attention kernel only if it is there."""
    assert _FUSED is not None and _FUSED_BACKWARD is not None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tiled"])
def test_blockwise_attention_equals_sdpa(fused):
    q, k, v = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    pos = torch.arange(40)
    out, _ = block_forward(q, k, v, pos, pos, allow_fused=fused)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - want).abs().max() < 1e-5


@pytest.mark.parametrize(
    "q_at, k_at",
    [
        ("zigzag", "zigzag"),  # a ring's diagonal step
        ("zigzag", "all"),  # all-gather: each chunk against its visible prefix
        ("zigzag", "first"),  # a ring step against an earlier rank's K/V
        ("gap", "all"),  # keys at the queries' positions missing: the fused path must decline
    ],
)
@pytest.mark.parametrize("with_docs", [False, True], ids=["causal", "documents"])
def test_fused_and_tiled_blocks_agree(q_at, k_at, with_docs):
    """Both ways of computing a block give the same output, log-sum-exp and gradients (the gradients
    given a final output and log-sum-exp over more keys than the block's, as in the ring); under a
    document mask the fused kernel takes every block, with the mask as an additive one."""
    positions = {"zigzag": zigzag_positions(1, 4, 64), "all": torch.arange(64), "first": torch.arange(8, 16)}
    positions["gap"] = torch.cat([torch.arange(20, 28), torch.arange(40, 48)])
    q_pos, k_pos = positions[q_at], positions[k_at]
    if q_at == "gap":
        k_pos = torch.cat([torch.arange(0, 22), torch.arange(30, 64)])
    parts = _fused_parts(Positions.of(q_pos), Positions.of(k_pos))
    assert (parts is None) == (q_at == "gap")  # which path "fused" takes
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, q_pos.numel(), 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, k_pos.numel(), 8, generator=gen) for _ in range(2))
    doc_of = torch.cat([packed_documents(1), packed_documents(2) + 16], dim=1)  # ids of positions 0..63
    docs = (doc_of[:, q_pos], doc_of[:, k_pos]) if with_docs else None
    results = []
    for fused in (True, False):
        out, lse = block_forward(q, k, v, q_pos, k_pos, allow_fused=fused, docs=docs)
        final_out, final_lse = out + 0.1, lse + 0.5  # as if other blocks had been merged in
        grads = block_backward(
            q, k, v, q_pos, k_pos, final_out, final_lse, dout, allow_fused=fused, docs=docs
        )
        results.append((out, lse, *grads))
    for a, b in zip(*results, strict=True):  # (equal infinities: a row that sees no key has lse −inf)
        assert torch.where(a == b, 0.0, (a - b).abs()).max() < 1e-5
    # And the forward against plain masked attention in fp64 (for "gap" both runs above were tiled).
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / 8**0.5
    hidden = k_pos[None, :] > q_pos[:, None]
    if with_docs:
        hidden = (hidden | (docs[0][:, :, None] != docs[1][:, None, :]))[:, None]
    s = s.masked_fill(hidden, float("-inf"))
    want = (s.softmax(-1) @ v.double().repeat_interleave(2, 1)).nan_to_num()  # a row seeing no key: 0
    assert (results[1][0] - want).abs().max() < 1e-5
    want_lse = torch.logsumexp(s, -1)
    assert torch.where(results[1][1] == want_lse, 0.0, (results[1][1] - want_lse).abs()).max() < 1e-5


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_the_ring_steps_a_document_mask_skips_are_those_the_mask_leaves_empty(ring, tmp_path):
    """`meshtron context --documents`' table and picture come from ring_step: every step it skips has
    no visible pair in the dense mask, and every step it computes has one (off the diagonal)."""
    generator = torch.Generator().manual_seed(ring)
    lengths = torch.randint(1, 12, (40,), generator=generator).tolist()
    lengths.append(-sum(lengths) % (2 * ring) or 2 * ring)  # the total a multiple of 2·ring
    docs = documents_of(lengths, ring)
    seq = docs.shape[1]
    i = torch.arange(seq)
    allowed = (i[:, None] >= i[None, :]) & (docs[0][:, None] == docs[0][None, :])
    skipped = skipped_steps(docs, ring)
    for r in range(ring):
        mine = zigzag_positions(r, ring, seq)
        for step in range(ring):
            theirs = zigzag_positions((r - step) % ring, ring, seq)
            assert skipped[r][step] == (not allowed[mine][:, theirs].any())
    assert any(map(any, skipped)) or ring == 2
    assert draw_documents(lengths, ring, tmp_path / "docs.png").stat().st_size > 0


@pytest.mark.parametrize("seed", range(5))
def test_positions_answer_as_their_tensor_does(seed):
    """Blocks plan their tiles from runs of positions on the host (models/block_positions.py): every
    question they ask gives what the tensor of those positions gives, for random rising runs and slices."""
    rng = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 5, (4,), generator=rng).cumsum(0) * 10
    lengths = torch.randint(0, 9, (4,), generator=rng)
    tensor = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(starts, lengths, strict=True)])
    positions = Positions.of(tensor)
    assert torch.equal(positions.on("cpu"), tensor) and len(positions) == tensor.numel()
    for begin in range(tensor.numel() + 1):
        for end in range(begin, tensor.numel() + 1):
            assert torch.equal(positions[begin:end].on("cpu"), tensor[begin:end])
    for x in range(-2, 60):
        assert positions.count_upto(x) == int((tensor <= x).sum())
    assert [positions.at(i) for i in range(tensor.numel())] == tensor.tolist()
    bounds = [b for b, _ in positions.segments()] + [tensor.numel()]
    jumps = [i for i in range(1, tensor.numel()) if tensor[i] != tensor[i - 1] + 1]
    assert bounds == [0, *jumps, tensor.numel()] or tensor.numel() == 0
