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

Shapes: B batch, H query heads, K key/value heads (grouped-query attention: H = K·G), Sq and Sk the
block's query and key lengths, Dh the head dim. The score tile [B, H, tile, Sk] is the only quadratic
tensor, and it is freed tile by tile: nothing of size Sq × Sk is kept.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
# Score elements per tile (fp32: 64 MiB): bounds the transient memory of a long block.
TILE_ELEMENTS = 1 << 24


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


def _tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, heads: int, batch: int, window: int):
    """(query slice, key slice, mask) per tile of queries. A tile never spans a jump in the query
    positions (the two chunks a load-balanced rank holds), so each reads only the keys it can see."""
    rows = max(1, TILE_ELEMENTS // max(1, batch * heads * k_pos.numel()))
    jumps = (torch.nonzero(q_pos[1:] - q_pos[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *jumps, q_pos.numel()]
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
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


def block_forward(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, Sq, Dh], log-sum-exp [B, H, Sq]) of the queries over these keys, both fp32. A row
    that sees no key has output 0 and log-sum-exp −inf."""
    B, H, Sq, D = q_BHSD.shape
    K, scale = k_BKSD.shape[1], D**-0.5
    q_g = _grouped(q_BHSD, K)
    out = q_g.new_zeros(q_g.shape)
    lse = q_g.new_full(q_g.shape[:-1], NEG_INF)
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window):
        if keys.stop == keys.start:
            continue
        s = _scores(q_g[..., rows, :], k_BKSD[:, :, keys], mask, scale)
        tile_lse = torch.logsumexp(s, dim=-1)
        p = _probabilities(s, tile_lse)
        out[..., rows, :] = torch.matmul(p, v_BKSD[:, :, keys].float()[:, :, None])
        lse[..., rows] = tile_lse
    return out.view(B, H, Sq, D), lse.view(B, H, Sq)


def block_backward(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    lse_BHS: torch.Tensor,
    delta_BHS: torch.Tensor,
    dout_BHSD: torch.Tensor,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in fp32 of this block's share of the loss, given each query's final log-sum-exp and
    δ = rowsum(dO ∘ O) over its final output."""
    B, H, Sq, D = q_BHSD.shape
    K, scale = k_BKSD.shape[1], D**-0.5
    q_g, do_g = _grouped(q_BHSD, K), _grouped(dout_BHSD, K)
    lse_g, delta_g = lse_BHS.view(B, K, H // K, Sq), delta_BHS.view(B, K, H // K, Sq)
    dq = torch.zeros_like(q_g)
    dk = torch.zeros(k_BKSD.shape, dtype=torch.float32, device=k_BKSD.device)
    dv = torch.zeros_like(dk)
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window):
        if keys.stop == keys.start:
            continue
        k, v = k_BKSD[:, :, keys].float()[:, :, None], v_BKSD[:, :, keys].float()[:, :, None]
        s = _scores(q_g[..., rows, :], k_BKSD[:, :, keys], mask, scale)
        p = _probabilities(s, lse_g[..., rows])
        do = do_g[..., rows, :]
        dv[:, :, keys] += torch.matmul(p.transpose(-1, -2), do).sum(2)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta_g[..., rows, None])
        dq[..., rows, :] = torch.matmul(ds, k) * scale
        dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), q_g[..., rows, :]).sum(2) * scale
    return dq.view(B, H, Sq, D), dk, dv


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
