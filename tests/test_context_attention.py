"""Context-parallel attention against the single-device attention, rank by rank: output, log-sum-exp,
dQ, dK, dV within 1e-5 (fp32) for every implementation at cp 2 and 4, with 1, 2 and n_heads key/value
heads, distinct K/V on every rank and a random upstream gradient (so a backward that reused a stale
K/V, or sent a dK/dV accumulator to the wrong rank, fails). Plus the zigzag map, the work balance and
the merge's robustness, which need no processes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from meshtron.comm import Comm
from meshtron.layout import ParallelDims
from meshtron.mesh import ParallelMesh
from meshtron.parallel.blockwise_attention import (
    _FUSED,
    _FUSED_BACKWARD,
    _fused_parts,
    block_backward,
    block_forward,
    merge_,
)
from meshtron.parallel.context import ContextParallelAttention, SequenceLayout, zigzag_positions

TOL = 1e-5
B, H, S, D = 2, 4, 32, 8
# impl -> cp_ulysses (hybrid splits cp 4 as ring 2 x ulysses 2)
IMPLS = {"ring": 1, "allgather": 1, "alltoall": None, "hybrid": 2}


def reference_attention(q, k, v, dout, window: int):
    """Single-device attention in fp64: output, log-sum-exp and the three gradients."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[2])
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & ((distance < window) if window else True)
    s = s.masked_fill(~allowed, float("-inf"))
    out = s.softmax(-1) @ vv
    lse = torch.logsumexp(s, -1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def cp_attention_errors(world: int) -> dict[str, float]:
    """On every rank: the largest error of each (impl, kv heads, window) case at cp = world."""
    comm, errors = Comm(), {}
    for impl, kv_heads, window in itertools.product(IMPLS, (1, 2, H), (0, 5)):
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
        want = reference_attention(q, k, v, dout, window)
        ring_degree = world // (ulysses if impl in ("alltoall", "hybrid") else 1)
        layout = SequenceLayout(S, ring_degree, world // ring_degree)
        mine = layout.positions(cp.rank)
        local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
        attention = ContextParallelAttention(comm, impl, ring, uly, window)
        out, lse = attention.with_lse(*local)
        out.backward(dout[:, :, mine])
        got = (out, lse, *(t.grad for t in local))
        errors[f"{impl}/kv{kv_heads}/w{window}"] = max(
            float((g.double() - w[:, :, mine]).abs().max()) for g, w in zip(got, want, strict=True)
        )
        mesh.close()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_every_implementation_matches_single_device_attention(workers, world):
    for rank, errors in enumerate(workers(world).run(cp_attention_errors, world)):
        assert len(errors) == (3 if world == 2 else 4) * 3 * 2
        bad = {case: err for case, err in errors.items() if not err <= TOL}
        assert not bad, f"rank {rank}: {bad}"


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
def test_fused_and_tiled_blocks_agree(q_at, k_at):
    """Both ways of computing a block give the same output, log-sum-exp and gradients (the gradients
    given a final output and log-sum-exp over more keys than the block's, as in the ring)."""
    positions = {"zigzag": zigzag_positions(1, 4, 64), "all": torch.arange(64), "first": torch.arange(8, 16)}
    positions["gap"] = torch.cat([torch.arange(20, 28), torch.arange(40, 48)])
    q_pos, k_pos = positions[q_at], positions[k_at]
    if q_at == "gap":
        k_pos = torch.cat([torch.arange(0, 22), torch.arange(30, 64)])
    assert (_fused_parts(q_pos, k_pos) is None) == (q_at == "gap")  # which path "fused" takes
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, q_pos.numel(), 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, k_pos.numel(), 8, generator=gen) for _ in range(2))
    results = []
    for fused in (True, False):
        out, lse = block_forward(q, k, v, q_pos, k_pos, allow_fused=fused)
        final_out, final_lse = out + 0.1, lse + 0.5  # as if other blocks had been merged in
        grads = block_backward(q, k, v, q_pos, k_pos, final_out, final_lse, dout, allow_fused=fused)
        results.append((out, lse, *grads))
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() < 1e-5
    # And the forward against plain masked attention in fp64 (for "gap" both runs above were tiled).
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / 8**0.5
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    want = s.softmax(-1) @ v.double().repeat_interleave(2, 1)
    assert (results[1][0] - want).abs().max() < 1e-5
    assert (results[1][1] - torch.logsumexp(s, -1)).abs().max() < 1e-5
