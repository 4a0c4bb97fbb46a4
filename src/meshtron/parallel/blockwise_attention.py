"""Causal attention of one block of queries against one block of keys, returning its log-sum-exp, and
the merge of such partial results: the arithmetic every context-parallel implementation shares.

A block is identified by the global positions of its queries and keys, so one rule masks every case:
key j is visible to query i when pos_k[j] <= pos_q[i] (and pos_q[i] - pos_k[j] < window with a sliding
window). Keys arrive sorted by position, so each tile of queries only reads the keys up to its last
position: the masked upper triangle is skipped, not computed.

  forward    s = q kᵀ·scale (masked) -> lse = logsumexp(s) -> o = softmax(s) v          (fp32)
  merge      two partial results (o₁, lse₁), (o₂, lse₂) of the same queries over disjoint keys:
             m = max(lse₁, lse₂); wᵢ = exp(lseᵢ − m) <= 1; lse = m + log(w₁ + w₂);
             o = (w₁ o₁ + w₂ o₂) / (w₁ + w₂)        -- no exponent is positive, so nothing overflows;
             rows that no key can see (lse = −inf everywhere) stay 0 with lse −inf
  backward   with the *final* o and lse of each query (FlashAttention-2, Dao 2023):
             p = exp(s − lse), δ = rowsum(dO ∘ o), dV = pᵀ dO, dS = p ∘ (dO vᵀ − δ),
             dQ = dS k·scale, dK = dSᵀ q·scale    -- so blocks can be differentiated one at a time

Two ways to compute a block, with the same results (tests/test_context_attention.py checks both):

  fused    on CPU without a sliding window: each run of consecutive query positions splits the keys
           into those all of its queries see (a full block) and those at its own positions (a causal
           square); PyTorch's fused CPU flash-attention kernel computes each part with its
           log-sum-exp, and its backward accepts the final output and log-sum-exp. Public SDPA does not
           return the log-sum-exp, so this calls the private ATen operator, here and nowhere else.
  tiled    everywhere else (sliding windows, CUDA, any positions): plain tensor ops over tiles of
           queries, [B, H, tile, Sk] scores at a time (TILE_ELEMENTS), never Sq × Sk.

Shapes: B batch, H query heads, K key/value heads (grouped-query attention: H = K·G), Sq and Sk the
block's query and key lengths, Dh the head dim.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

NEG_INF = float("-inf")
# Score elements per tile (fp32: 4 MiB): bounds the transient memory of a long block.
TILE_ELEMENTS = 1 << 20
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Sq, Sk] bool: which keys each query attends to (causal, and within `window` when it is > 0)."""
    distance = q_pos[:, None] - k_pos[None, :]
    allowed = distance >= 0
    return allowed & (distance < window) if window > 0 else allowed


def _key_range(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> tuple[int, int]:
    """The keys (sorted by position) any query of this tile can see: [lo, hi)."""
    hi = int(torch.searchsorted(k_pos, q_pos.max(), right=True))
    lo = int(torch.searchsorted(k_pos, q_pos.min() - window, right=True)) if window > 0 else 0
    return lo, max(lo, hi)


def _tiles(
    q_pos: torch.Tensor, k_pos: torch.Tensor, heads: int, batch: int, window: int
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """(query slice, key slice, mask) per tile of queries. A tile never spans a jump in the query
    positions (the two chunks a load-balanced rank holds), so each reads only the keys it can see, and
    it holds as many queries as fit TILE_ELEMENTS scores against the keys its run of queries can see."""
    for begin, end in _segments(q_pos):
        lo, hi = _key_range(q_pos[begin:end], k_pos, window)
        rows = max(1, TILE_ELEMENTS // max(1, batch * heads * (hi - lo)))
        for start in range(begin, end, rows):
            stop = min(start + rows, end)
            lo, hi = _key_range(q_pos[start:stop], k_pos, window)
            yield slice(start, stop), slice(lo, hi), visible(q_pos[start:stop], k_pos[lo:hi], window)


def _grouped(q_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, Dh] -> [B, K, G, S, Dh] in fp32: each key/value head with its group of query heads."""
    B, H, S, D = q_BHSD.shape
    return q_BHSD.float().view(B, kv_heads, H // kv_heads, S, D)


def _scores(q_g: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.matmul(q_g, k.float()[:, :, None].transpose(-1, -2)) * scale
    return s.masked_fill_(~mask, NEG_INF)


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s − lse), 0 for masked keys and for rows that see no key at all."""
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - finite[..., None])


def _segments(q_pos: torch.Tensor) -> list[tuple[int, int]]:
    """[begin, end) of each run of consecutive query positions (a load-balanced rank holds two)."""
    jumps = (torch.nonzero(q_pos[1:] - q_pos[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *jumps, q_pos.numel()]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _fused_parts(q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[tuple[slice, slice, bool]] | None:
    """(query rows, keys, causal) blocks the fused kernel can compute: per run of query positions
    [a, a + n), the keys before a (all visible) and the keys at a .. a + n − 1 (a causal square); None
    when the keys at the run's positions are not exactly those (then the tiled path masks by position)."""
    parts = []
    for begin, end in _segments(q_pos):
        first, n = int(q_pos[begin]), end - begin
        lo = int(torch.searchsorted(k_pos, first))
        hi = int(torch.searchsorted(k_pos, first + n))
        if lo > 0:
            parts.append((slice(begin, end), slice(0, lo), False))
        if hi > lo:
            if hi - lo != n or int(k_pos[lo]) != first:
                return None
            parts.append((slice(begin, end), slice(lo, hi), True))
    return parts


def _fused(
    q: torch.Tensor, window: int, q_pos: torch.Tensor, k_pos: torch.Tensor, allow_fused: bool
) -> list[tuple[slice, slice, bool]] | None:
    """The fused kernel's parts for this block, or None to take the tiled path."""
    if not allow_fused or window > 0 or q.device.type != "cpu" or _FUSED is None:
        return None
    return _fused_parts(q_pos, k_pos)


def block_forward(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int = 0,
    allow_fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, Sq, Dh], log-sum-exp [B, H, Sq]) of the queries over these keys, both fp32. A row
    that sees no key has output 0 and log-sum-exp −inf. `allow_fused=False` forces the tiled path."""
    out = torch.zeros(q_BHSD.shape, dtype=torch.float32, device=q_BHSD.device)
    lse = torch.full(q_BHSD.shape[:-1], NEG_INF, device=q_BHSD.device)
    parts = _fused(q_BHSD, window, q_pos, k_pos, allow_fused)
    if parts is not None:
        for rows, keys, causal in parts:
            part, part_lse = _FUSED(q_BHSD[:, :, rows], k_BKSD[:, :, keys], v_BKSD[:, :, keys], 0.0, causal)
            merge_(out[:, :, rows], lse[:, :, rows], part.float(), part_lse)
        return out, lse
    B, H, Sq, D = q_BHSD.shape
    K, scale = k_BKSD.shape[1], D**-0.5
    q_g, out_g, lse_g = _grouped(q_BHSD, K), out.view(B, K, H // K, Sq, D), lse.view(B, K, H // K, Sq)
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window):
        if keys.stop == keys.start:
            continue
        s = _scores(q_g[..., rows, :], k_BKSD[:, :, keys], mask, scale)
        m = s.amax(dim=-1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row that sees no key: p = 0
        p = torch.exp(s - m[..., None])
        total = p.sum(-1)
        out_g[..., rows, :] = (
            torch.matmul(p, v_BKSD[:, :, keys].float()[:, :, None])
            / torch.where(total > 0, total, torch.ones_like(total))[..., None]
        )
        lse_g[..., rows] = m + torch.log(total)
    return out, lse


def block_backward(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    dout_BHSD: torch.Tensor,
    window: int = 0,
    allow_fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in fp32 of this block's share of the loss, given each query's final output and
    log-sum-exp (over all its keys, not only this block's)."""
    dq = torch.zeros(q_BHSD.shape, dtype=torch.float32, device=q_BHSD.device)
    dk = torch.zeros(k_BKSD.shape, dtype=torch.float32, device=k_BKSD.device)
    dv = torch.zeros_like(dk)
    parts = _fused(q_BHSD, window, q_pos, k_pos, allow_fused)
    if parts is not None:
        out = out_BHSD.to(q_BHSD.dtype)  # the kernel takes every tensor but the log-sum-exp in q's dtype
        for rows, keys, causal in parts:
            grads = _FUSED_BACKWARD(
                dout_BHSD[:, :, rows], q_BHSD[:, :, rows], k_BKSD[:, :, keys], v_BKSD[:, :, keys],
                out[:, :, rows], lse_BHS[:, :, rows], 0.0, causal,
            )  # fmt: skip
            dq[:, :, rows] += grads[0]
            dk[:, :, keys] += grads[1]
            dv[:, :, keys] += grads[2]
        return dq, dk, dv
    _tiled_backward(q_BHSD, k_BKSD, v_BKSD, q_pos, k_pos, out_BHSD, lse_BHS, dout_BHSD, window, (dq, dk, dv))
    return dq, dk, dv


def _tiled_backward(
    q_BHSD, k_BKSD, v_BKSD, q_pos, k_pos, out_BHSD, lse_BHS, dout_BHSD, window, grads
) -> None:
    """block_backward's tiled path: accumulates into grads = (dq, dk, dv)."""
    B, H, Sq, D = q_BHSD.shape
    K, scale = k_BKSD.shape[1], D**-0.5
    q_g, do_g = _grouped(q_BHSD, K), _grouped(dout_BHSD, K)
    lse_g, delta_g = lse_BHS.view(B, K, H // K, Sq), delta(out_BHSD, dout_BHSD).view(B, K, H // K, Sq)
    dq, dk, dv = grads[0].view(B, K, H // K, Sq, D), grads[1], grads[2]
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window):
        if keys.stop == keys.start:
            continue
        k, v = k_BKSD[:, :, keys].float()[:, :, None], v_BKSD[:, :, keys].float()[:, :, None]
        s = _scores(q_g[..., rows, :], k_BKSD[:, :, keys], mask, scale)
        p = _probabilities(s, lse_g[..., rows])
        do = do_g[..., rows, :]
        dv[:, :, keys] += torch.matmul(p.transpose(-1, -2), do).sum(2)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta_g[..., rows, None])
        dq[..., rows, :] += torch.matmul(ds, k) * scale
        dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), q_g[..., rows, :]).sum(2) * scale


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's partial (output, log-sum-exp) into the running ones, in place, in fp32."""
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both −inf: weights 0, keep 0 / −inf
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_old + w_new
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out.mul_((w_old / safe)[..., None]).add_(block_out * (w_new / safe)[..., None])
    lse.copy_(m + torch.log(total))


def delta(out_BHSD: torch.Tensor, dout_BHSD: torch.Tensor) -> torch.Tensor:
    """δ = rowsum(dO ∘ O) [B, H, S] in fp32, the softmax backward's per-row correction."""
    return (dout_BHSD.float() * out_BHSD.float()).sum(-1)
