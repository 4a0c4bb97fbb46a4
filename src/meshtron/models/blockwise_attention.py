"""Causal attention of one block of queries against one block of keys, returning its log-sum-exp, and
the merge of such partial results: the arithmetic every context-parallel implementation shares
(parallel/context.py), and the path of a document mask on one rank's CPU (`attend_blockwise`: no
[S, S] mask is built or kept, and the work of keys in other documents is skipped).

A block is identified by the global positions of its queries and keys (block_positions.py: runs of
consecutive positions, known on the host, so planning tiles reads nothing from the device), so one rule
masks every case:
key j is visible to query i when pos_k[j] <= pos_q[i] (and pos_q[i] - pos_k[j] < window with a sliding
window, and doc_k[j] = doc_q[i] under a document mask, `docs`). Keys arrive sorted by position, so each
tile of queries only reads the keys up to its last position: the masked upper triangle is skipped, not
computed. Documents are runs of consecutive positions, so their ids rise with position too, and a tile
also skips every key before the first document its queries are in.

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
           Under a document mask the kernel takes each tile's mask as an additive one (0 or −inf) over
           the keys the tile can see; a row that sees none of them gets log-sum-exp −inf.
  tiled    everywhere else (sliding windows, CUDA, any positions): plain tensor ops over tiles of
           queries, [B, H, tile, Sk] scores at a time (TILE_ELEMENTS), never Sq × Sk.

Shapes: B batch, H query heads, K key/value heads (grouped-query attention: H = K·G), Sq and Sk the
block's query and key lengths, Dh the head dim of queries and keys, Dv of values and outputs (MLA's
differ: models/latent_attention.py; the fused kernel wants one size, so its values are padded with zeros
to Dh for the kernel alone, which changes no result). `scale` is the logits' scale, 1/sqrt(Dh) unless
given.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from meshtron.models.block_positions import Positions, as_positions

NEG_INF = float("-inf")
# Score elements per tile (fp32: 4 MiB): bounds the transient memory of a long block.
TILE_ELEMENTS = 1 << 20
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


Documents = tuple[torch.Tensor, torch.Tensor]  # (doc_q [B, Sq], doc_k [B, Sk]): document ids


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Sq, Sk] bool: which keys each query attends to (causal, and within `window` when it is > 0)."""
    distance = q_pos[:, None] - k_pos[None, :]
    allowed = distance >= 0
    return allowed & (distance < window) if window > 0 else allowed


def _key_range(
    q_pos: Positions, k_pos: Positions, window: int, docs: Documents | None = None
) -> tuple[int, int]:
    """The keys (sorted by position) any query of this tile can see: [lo, hi). From the positions alone
    nothing is read from the device; a document mask reads the tile's first document ids."""
    hi = k_pos.count_upto(q_pos.last())
    lo = k_pos.count_upto(q_pos.first() - window) if window > 0 else 0
    if docs is not None:  # keys of documents before every query's own (per sequence; the earliest)
        first_doc_B1 = docs[0].amin(dim=1, keepdim=True)
        lo = max(lo, int(torch.searchsorted(docs[1].contiguous(), first_doc_B1).min()))
    return lo, max(lo, hi)


def _tiles(
    q_pos: Positions,
    k_pos: Positions,
    heads: int,
    batch: int,
    window: int,
    docs: Documents | None,
    device: torch.device,
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """(query slice, key slice, mask) per tile of queries. A tile never spans a jump in the query
    positions (the two chunks a load-balanced rank holds), so each reads only the keys it can see, and
    it holds as many queries as fit TILE_ELEMENTS scores against the keys its run of queries can see.
    The mask is [Sq, Sk], or [B, 1, 1, Sq, Sk] under a document mask."""
    for begin, end in q_pos.segments():
        lo, hi = _key_range(q_pos[begin:end], k_pos, window, _rows(docs, slice(begin, end)))
        rows = max(1, TILE_ELEMENTS // max(1, batch * heads * (hi - lo)))
        for start in range(begin, end, rows):
            tile = slice(start, min(start + rows, end))
            tile_docs = _rows(docs, tile)
            lo, hi = _key_range(q_pos[tile], k_pos, window, tile_docs)
            mask = visible(q_pos[tile].on(device), k_pos[lo:hi].on(device), window)
            if tile_docs is not None:
                same = tile_docs[0][:, :, None] == tile_docs[1][:, None, lo:hi]
                mask = (mask & same)[:, None, None]
            yield tile, slice(lo, hi), mask


def _rows(docs: Documents | None, rows: slice) -> Documents | None:
    return None if docs is None else (docs[0][:, rows], docs[1])


def shares_document(docs: Documents) -> bool:
    """Whether any query of the block is in a document some key of it is in (ids rise with position,
    so each sequence's key ids are sorted: look every query's id up among them)."""
    doc_q, doc_k = docs
    at = torch.searchsorted(doc_k.contiguous(), doc_q.contiguous()).clamp_(max=doc_k.shape[1] - 1)
    return bool((doc_k.gather(1, at) == doc_q).any())


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


def _fused_parts(q_pos: Positions, k_pos: Positions) -> list[tuple[slice, slice, bool]] | None:
    """(query rows, keys, causal) blocks the fused kernel can compute: per run of query positions
    [a, a + n), the keys before a (all visible) and the keys at a .. a + n − 1 (a causal square); None
    when the keys at the run's positions are not exactly those (then the tiled path masks by position)."""
    parts = []
    for begin, end in q_pos.segments():
        first, n = q_pos.at(begin), end - begin
        lo, hi = k_pos.count_upto(first - 1), k_pos.count_upto(first + n - 1)
        if lo > 0:
            parts.append((slice(begin, end), slice(0, lo), False))
        if hi > lo:
            if hi - lo != n or k_pos.at(lo) != first:
                return None
            parts.append((slice(begin, end), slice(lo, hi), True))
    return parts


def _fused(
    q: torch.Tensor,
    window: int,
    q_pos: Positions,
    k_pos: Positions,
    allow_fused: bool,
    docs: Documents | None,
) -> list[tuple[slice, slice, bool, torch.Tensor | None]] | None:
    """The fused kernel's parts for this block, (query rows, keys, causal, additive mask or None), or
    None to take the tiled path. Under a document mask: each tile with its mask over the keys it sees."""
    if not allow_fused or window > 0 or q.device.type != "cpu" or _FUSED is None:
        return None
    if docs is None:
        parts = _fused_parts(q_pos, k_pos)
        return None if parts is None else [(rows, keys, causal, None) for rows, keys, causal in parts]
    B, H = q.shape[:2]
    zero, minus_inf = torch.zeros((), dtype=q.dtype), torch.full((), NEG_INF, dtype=q.dtype)
    return [
        (rows, keys, False, torch.where(mask[:, 0], zero, minus_inf))
        for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window, docs, q.device)
        if keys.stop > keys.start
    ]


def _padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """x with its last dim padded with zeros to `size` (the fused kernel's one head size)."""
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def block_forward(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    q_pos: Positions | torch.Tensor,
    k_pos: Positions | torch.Tensor,
    window: int = 0,
    allow_fused: bool = True,
    docs: Documents | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, Sq, Dv], log-sum-exp [B, H, Sq]) of the queries over these keys, both fp32. A row
    that sees no key has output 0 and log-sum-exp −inf. `allow_fused=False` forces the tiled path;
    `docs`: the queries' and keys' document ids, under a document mask."""
    q_pos, k_pos = as_positions(q_pos), as_positions(k_pos)
    B, H, Sq, D = q_BHSD.shape
    Dv, kernel_scale, scale = v_BKSD.shape[-1], scale, D**-0.5 if scale is None else scale
    out = torch.zeros((B, H, Sq, Dv), dtype=torch.float32, device=q_BHSD.device)
    lse = torch.full(q_BHSD.shape[:-1], NEG_INF, device=q_BHSD.device)
    parts = _fused(q_BHSD, window, q_pos, k_pos, allow_fused and Dv <= D, docs)
    if parts is not None:
        for rows, keys, causal, mask in parts:
            q, k, v = q_BHSD[:, :, rows], k_BKSD[:, :, keys], _padded(v_BKSD[:, :, keys], D)
            part, part_lse = _FUSED(q, k, v, 0.0, causal, attn_mask=mask, scale=kernel_scale)
            if mask is not None:  # the kernel gives a row that sees no key log-sum-exp 0
                part_lse = part_lse.masked_fill(torch.isinf(mask).all(-1), NEG_INF)
            merge_(out[:, :, rows], lse[:, :, rows], part[..., :Dv].float(), part_lse)
        return out, lse
    K = k_BKSD.shape[1]
    q_g, out_g, lse_g = _grouped(q_BHSD, K), out.view(B, K, H // K, Sq, Dv), lse.view(B, K, H // K, Sq)
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window, docs, q_BHSD.device):
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
    q_pos: Positions | torch.Tensor,
    k_pos: Positions | torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    dout_BHSD: torch.Tensor,
    window: int = 0,
    allow_fused: bool = True,
    docs: Documents | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in fp32 of this block's share of the loss, given each query's final output and
    log-sum-exp (over all its keys, not only this block's)."""
    q_pos, k_pos = as_positions(q_pos), as_positions(k_pos)
    D, Dv, kernel_scale = q_BHSD.shape[-1], v_BKSD.shape[-1], scale
    scale = D**-0.5 if scale is None else scale
    dq = torch.zeros(q_BHSD.shape, dtype=torch.float32, device=q_BHSD.device)
    dk = torch.zeros(k_BKSD.shape, dtype=torch.float32, device=k_BKSD.device)
    dv = torch.zeros(v_BKSD.shape, dtype=torch.float32, device=v_BKSD.device)
    parts = _fused(q_BHSD, window, q_pos, k_pos, allow_fused and Dv <= D, docs)
    if parts is not None:
        out = _padded(out_BHSD.to(q_BHSD.dtype), D)  # the kernel takes all but the lse in q's dtype
        lse = torch.where(torch.isinf(lse_BHS), torch.zeros_like(lse_BHS), lse_BHS)  # no key seen: p = 0
        dout, v = _padded(dout_BHSD, D), _padded(v_BKSD, D)
        for rows, keys, causal, mask in parts:
            grads = _FUSED_BACKWARD(
                dout[:, :, rows],
                q_BHSD[:, :, rows],
                k_BKSD[:, :, keys],
                v[:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                0.0,
                causal,
                attn_mask=mask,
                scale=kernel_scale,
            )
            dq[:, :, rows] += grads[0]
            dk[:, :, keys] += grads[1]
            dv[:, :, keys] += grads[2][..., :Dv]
        return dq, dk, dv
    grads = (dq, dk, dv)
    where = (q_pos, k_pos, window, docs, scale)
    _tiled_backward(q_BHSD, k_BKSD, v_BKSD, out_BHSD, lse_BHS, dout_BHSD, where, grads)
    return dq, dk, dv


def _tiled_backward(q_BHSD, k_BKSD, v_BKSD, out_BHSD, lse_BHS, dout_BHSD, where, grads) -> None:
    """block_backward's tiled path: accumulates into grads = (dq, dk, dv); `where` = (q_pos, k_pos,
    window, docs, scale)."""
    q_pos, k_pos, window, docs, scale = where
    B, H, Sq, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    q_g, do_g = _grouped(q_BHSD, K), _grouped(dout_BHSD, K)
    lse_g, delta_g = lse_BHS.view(B, K, H // K, Sq), delta(out_BHSD, dout_BHSD).view(B, K, H // K, Sq)
    dq, dk, dv = grads[0].view(B, K, H // K, Sq, D), grads[1], grads[2]
    for rows, keys, mask in _tiles(q_pos, k_pos, H, B, window, docs, q_BHSD.device):
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


def docs_at(docs_BS: Tensor | None, q_pos: Positions, k_pos: Positions) -> Documents | None:
    """The document ids of a block's queries and keys, looked up in the whole window's [B, S]."""
    if docs_BS is None:
        return None
    return docs_BS[:, q_pos.on(docs_BS.device)], docs_BS[:, k_pos.on(docs_BS.device)]


class Saved(NamedTuple):
    """What attention's forward keeps for its backward: the inputs, the output, the fp32 log-sum-exp."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


@dataclass
class LocalPass:
    """Attention over a whole sequence on one rank (without cp, or inside Ulysses after the heads were
    exchanged)."""

    window: int = 0
    scale: float | None = None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        pos = Positions.arange(0, q.shape[2])
        docs = docs_at(docs_BS, pos, pos)
        return block_forward(q, k, v, pos, pos, self.window, docs=docs, scale=self.scale)

    def backward(self, saved: Saved, dout: Tensor, docs_BS: Tensor | None = None) -> tuple[Tensor, ...]:
        q, k, v, out, lse = saved
        pos = Positions.arange(0, q.shape[2])
        docs = docs_at(docs_BS, pos, pos)
        return block_backward(q, k, v, pos, pos, out, lse, dout, self.window, docs=docs, scale=self.scale)


def heads_last_in_memory(out_BHSD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out_BHSD` in `dtype`, laid out [B, S, H, D] in memory as a fused kernel's output is: the output
    projection reads it as [B, S, H·D] without a copy, and backward keeps that one tensor."""
    out_BSHD = torch.empty(out_BHSD.transpose(1, 2).shape, dtype=dtype, device=out_BHSD.device)
    return out_BSHD.copy_(out_BHSD.transpose(1, 2)).transpose(1, 2)


class BlockwiseAttention(torch.autograd.Function):
    """Autograd around a pass: forward keeps q, k, v, the output (in q's dtype) and the fp32 log-sum-exp;
    backward asks the pass for dQ, dK, dV (a ring pass reruns its ring with the saved K/V, never a stale
    one)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, attention_pass: Any, docs_BS: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):  # the passes choose their own precision
            out, lse = attention_pass.forward(q, k, v, docs_BS)
        out = heads_last_in_memory(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attention_pass, ctx.docs_BS = attention_pass, docs_BS
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.attention_pass.backward(Saved(q, k, v, out, lse), dout, ctx.docs_BS)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def one_dtype(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in the dtype attention runs in: autocast's (as SDPA would be cast without cp; under
    autocast the rotary embedding returns q and k in fp32 while v is bf16), else their common one."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def attend_blockwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    docs_BS: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of a whole sequence, q [B, H, S, Dh] over k [B, K, S, Dh] and v [B, K, S, Dv],
    through the blockwise path (within each document of `docs_BS` [B, S], when given)."""
    q, k, v = one_dtype(q, k, v)
    return BlockwiseAttention.apply(q, k, v, LocalPass(window, scale), docs_BS)[0]
