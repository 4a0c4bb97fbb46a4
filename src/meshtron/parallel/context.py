"""Context parallel: each sequence split over the cp ranks, which meet only inside attention.

Everything but attention works token by token, so a rank runs its share of the sequence through the
embedding, norms, projections, FFN/MoE and loss alone. Attention is replaced by one of four exchanges
(`parallel.cp_impl`; docs/context-parallel.md draws them):

  ring       K/V travel round the cp ranks point to point, the next hop posted before the current
             block is computed; partial outputs merge by log-sum-exp (blockwise_attention.py). Backward
             runs the ring again: dQ stays, dK/dV accumulators (fp32) travel with their K/V and arrive
             home after cp hops. Per layer: forward 2·b·s·k·(cp−1)/cp elements sent, backward the same
             plus the accumulators' 2·b·s·k (fp32)                            (Liu et al. 2023)
  allgather  K/V all-gathered (again in backward), each rank attends its chunks against the visible
             prefix, dK/dV reduce-scattered                                   (Llama 3, Dubey et al. 2024)
  alltoall   all-to-all swaps the sequence split for a head split, attention runs on whole sequences,
             a last all-to-all swaps back; 4 all-to-alls forward, 4 backward (DeepSpeed-Ulysses,
             Jacobs et al. 2023); key/value heads fewer than cp are replicated first
  hybrid     cp = ring × ulysses: all-to-all inside groups of cp_ulysses ranks, then a ring over the
             groups (USP, Fang & Zhao 2024)

Causal load balancing (zigzag): the sequence is cut into 2·R chunks for a ring of R ranks and ring rank
r holds chunks r and 2R−1−r, so every rank does the same attention work; inside a ring rank's share the
cp_ulysses ranks hold consecutive pieces. Tokens, labels and positions are sharded by the same index
map (`SequenceLayout`), RoPE sees each token's global position, and the loss divides by the global token
count, so any cp gives the cp = 1 update. The cp ranks hold the same parameters: gradients are reduced
over dp × cp, and ZeRO/FSDP shard over dp_shard × cp (data_parallel.py).

Documents (`data.document_mask`): every cp rank forms the document ids of the whole window from its
tokens before the window is cut (models/documents.py), so each pass looks up the ids of any positions
it holds with no exchange: a ring step whose queries and keys share no document is skipped whole (and
counted, `RingPass.blocks_skipped`), and inside a block each tile of queries skips the keys of earlier
documents (blockwise_attention.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import CpImpl
from meshtron.models.block_positions import Positions
from meshtron.models.blockwise_attention import (
    BlockwiseAttention,
    Documents,
    LocalPass,
    Saved,
    block_backward,
    block_forward,
    docs_at,
    merge_,
    one_dtype,
    shares_document,
)
from meshtron.models.llama import Transformer


def zigzag_runs(index: int, parts: int, seq_len: int) -> Positions:
    """Global positions held by rank `index` of `parts` under load balancing: chunks index and
    2·parts−1−index of the sequence cut into 2·parts chunks (the whole sequence for parts = 1)."""
    if parts == 1:
        return Positions.arange(0, seq_len)
    c = seq_len // (2 * parts)
    return Positions(((index * c, c), ((2 * parts - 1 - index) * c, c)))


def zigzag_positions(index: int, parts: int, seq_len: int) -> torch.Tensor:
    """`zigzag_runs` as a tensor (on the CPU)."""
    return zigzag_runs(index, parts, seq_len).on("cpu")


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of a sequence each cp rank holds. cp rank k = ring rank · ulysses + ulysses rank:
    zigzag over the ring ranks, consecutive pieces over the Ulysses ranks inside a ring rank's share."""

    seq_len: int
    ring: int
    ulysses: int = 1

    def positions(self, cp_rank: int) -> torch.Tensor:
        ring_rank, ulysses_rank = divmod(cp_rank, self.ulysses)
        share = zigzag_positions(ring_rank, self.ring, self.seq_len)
        return share.chunk(self.ulysses)[ulysses_rank]


def ring_block(r: int, j: int, local_len: int) -> tuple[slice, slice]:
    """(query rows, key columns) of the ring step where rank r holds rank j's K/V: the diagonal block
    (causal inside), all queries against the first half of the keys (j < r), or the second half of
    the queries against all keys (j > r); the other quarters are masked out whole."""
    half, whole = local_len // 2, slice(None)
    if j == r:
        return whole, whole
    return (whole, slice(0, half)) if j < r else (slice(half, None), whole)


class RingHop:
    """One ring hop in progress: `x` sent to the next rank, the previous rank's tensor arriving."""

    def __init__(self, comm: Comm, group: CommGroup, x: torch.Tensor):
        n, r = group.size, group.rank
        self.x = x.contiguous()  # kept alive until the send is done
        self.pending, self.buffer = comm.sendrecv(self.x, group, (r + 1) % n, (r - 1) % n)

    def result(self) -> torch.Tensor:
        self.pending.wait()
        return self.buffer


# (query rows, key columns, their positions, their document ids or None) of one ring step.
RingStep = tuple[slice, slice, Positions, Positions, Documents | None]
# (a ring message, the positions wanted) -> their keys [B, K, s, Dk] and values [B, K, s, Dv]
KeysValues = Callable[[Tensor, slice], tuple[Tensor, Tensor]]


def ring_step(r: int, j: int, ring: int, local_len: int, docs_BS: Tensor | None = None) -> RingStep | None:
    """What rank r computes when it holds rank j's K/V (ring_block), with positions and document ids;
    None when a document mask leaves nothing of it: no query shares a document with a key (every key
    of a step but the diagonal comes before every query, so a shared document is a visible pair)."""
    rows, keys = ring_block(r, j, local_len)
    q_pos = zigzag_runs(r, ring, local_len * ring)[rows]
    k_pos = zigzag_runs(j, ring, local_len * ring)[keys]
    docs = docs_at(docs_BS, q_pos, k_pos)
    if docs is not None and j != r and not shares_document(docs):
        return None
    return rows, keys, q_pos, k_pos, docs


@dataclass
class RingPass:
    """Ring attention over `group`: each rank's queries against every rank's keys, one hop at a time.
    `exposed_s` adds up the time spent waiting for hops after the compute they overlapped (what the
    overlap failed to hide; benchmarks/context_parallel.py reports it). Under a document mask, ring
    steps whose queries and keys share no document are skipped: `blocks_skipped` of `blocks` (forward
    and backward alike) counts them."""

    comm: Comm
    group: CommGroup
    window: int = 0
    scale: float | None = None
    exposed_s: float = 0.0
    blocks: int = 0
    blocks_skipped: int = 0

    def land(self, flight: RingHop) -> torch.Tensor:
        start = time.perf_counter()
        out = flight.result()
        self.exposed_s += time.perf_counter() - start
        return out

    def block(self, r: int, j: int, S: int, docs_BS: Tensor | None) -> RingStep | None:
        """ring_step, counted."""
        step = ring_step(r, j, self.group.size, S, docs_BS)
        self.blocks += 1
        self.blocks_skipped += step is None
        return step

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        Dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)  # one message per hop: [B, K, S/cp, Dk + Dv]

        def split(kv_j: Tensor, keys: slice) -> tuple[Tensor, Tensor]:
            return kv_j[:, :, keys, :Dk], kv_j[:, :, keys, Dk:]

        return self.ring_forward(q, kv, split, v.shape[-1], docs_BS)

    def ring_forward(
        self, q: Tensor, message: Tensor, keys_values: KeysValues, v_dim: int, docs_BS: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The forward ring over any message: `keys_values(message, keys)` gives the keys and values of
        those of its positions (a slice of K/V, or latents up-projected on arrival)."""
        n, r, S = self.group.size, self.group.rank, q.shape[2]
        out = torch.zeros((*q.shape[:-1], v_dim), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        for i in range(n):
            flight = RingHop(self.comm, self.group, message) if i < n - 1 else None  # overlaps this block
            block = self.block(r, (r - i) % n, S, docs_BS)
            if block is not None:
                rows, keys, q_pos, k_pos, docs = block
                k_j, v_j = keys_values(message, keys)
                part, part_lse = block_forward(
                    q[:, :, rows], k_j, v_j, q_pos, k_pos, self.window, docs=docs, scale=self.scale
                )
                merge_(out[:, :, rows], lse[:, :, rows], part, part_lse)
            if flight is not None:
                message = self.land(flight)
        return out, lse

    def backward(self, saved: Saved, dout: Tensor, docs_BS: Tensor | None = None) -> tuple[Tensor, ...]:
        q, k, v, out, lse = saved
        n, r, S, Dk = self.group.size, self.group.rank, q.shape[2], k.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # rank r's own K/V's, at i = 0
        accumulator: RingHop | None = None
        for i in range(n):
            j = (r - i) % n
            flight = RingHop(self.comm, self.group, kv) if i < n - 1 else None
            block = self.block(r, j, S, docs_BS)
            grads = None
            if block is not None:
                rows, keys, q_pos, k_pos, docs = block
                k_j, v_j = kv[:, :, keys, :Dk], kv[:, :, keys, Dk:]
                grads = block_backward(
                    q[:, :, rows],
                    k_j,
                    v_j,
                    q_pos,
                    k_pos,
                    out[:, :, rows],
                    lse[:, :, rows],
                    dout[:, :, rows],
                    self.window,
                    docs=docs,
                    scale=self.scale,
                )
                dq[:, :, rows] += grads[0]
            if accumulator is not None:  # rank j's dK/dV, arriving from the previous rank
                dkv = self.land(accumulator)
            if grads is not None:
                dkv[:, :, keys, :Dk] += grads[1]
                dkv[:, :, keys, Dk:] += grads[2]
            accumulator = RingHop(self.comm, self.group, dkv)  # on to the next rank, home after n hops
            if flight is not None:
                kv = self.land(flight)
        dkv = self.land(accumulator)
        return dq, dkv[..., :Dk], dkv[..., Dk:]


@dataclass
class GatherPass:
    """All-gather attention: every rank's K/V gathered in position order; each query sees its prefix."""

    comm: Comm
    group: CommGroup
    window: int = 0
    scale: float | None = None

    def _chunks(self, rank_major: Tensor) -> list[Tensor]:
        """Views of [n, ..., S/n, Dh] (rank j's two chunks along dim −2) in position order."""
        n, half = self.group.size, rank_major.shape[-2] // 2
        owner = [(c, 0) if c < n else (2 * n - 1 - c, 1) for c in range(2 * n)]  # (rank, which half)
        return [rank_major[j, ..., h * half : (h + 1) * half, :] for j, h in owner]

    def gathered(self, k: Tensor, v: Tensor) -> Tensor:
        """K/V of the whole sequence [B, K, S, Dk + Dv] in position order (one copy after the gather)."""
        kv_rank_major = self.comm.all_gather_tensor(torch.cat([k, v], dim=-1)[None], self.group, dim=0)
        return torch.cat(self._chunks(kv_rank_major), dim=-2)

    def positions(self, q: Tensor) -> tuple[Positions, Positions]:
        n, S = self.group.size, q.shape[2]
        return zigzag_runs(self.group.rank, n, S * n), Positions.arange(0, S * n)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        kv, positions, Dk = self.gathered(k, v), self.positions(q), k.shape[-1]
        docs = docs_at(docs_BS, *positions)
        return block_forward(
            q, kv[..., :Dk], kv[..., Dk:], *positions, self.window, docs=docs, scale=self.scale
        )

    def backward(self, saved: Saved, dout: Tensor, docs_BS: Tensor | None = None) -> tuple[Tensor, ...]:
        q, k, v, out, lse = saved
        kv, positions = self.gathered(k, v), self.positions(q)
        docs = docs_at(docs_BS, *positions)
        Dk, scale = k.shape[-1], self.scale
        k_all, v_all = kv[..., :Dk], kv[..., Dk:]
        dq, dk, dv = block_backward(
            q, k_all, v_all, *positions, out, lse, dout, self.window, docs=docs, scale=scale
        )
        dkv = torch.cat([dk, dv], dim=-1)  # in position order; back to rank-major, then each rank its own
        n, S = self.group.size, q.shape[2]
        rank_major = torch.empty((n, *dkv.shape[:-2], S, dkv.shape[-1]), dtype=torch.float32, device=q.device)
        for view, chunk in zip(self._chunks(rank_major), dkv.split(S // 2, dim=-2), strict=True):
            view.copy_(chunk)
        dkv = self.comm.reduce_scatter_tensor(rank_major, self.group, dim=0)[0]
        return dq, dkv[..., :Dk], dkv[..., Dk:]


class ContextParallelAttention:
    """What `Attention.attend` becomes under cp: rotated q [B, H, S/cp, Dh], k [B, K, S/cp, Dh] and v
    [B, K, S/cp, Dv] of this rank's tokens in, this rank's attention output out. Under a document mask,
    `docs_BS` holds the document ids of the whole window [B, S] (not only this rank's tokens). `window`
    and `scale`: the attention's sliding window and logits' scale (None: 1/sqrt(Dh))."""

    def __init__(
        self,
        comm: Comm,
        impl: str,
        ring: CommGroup | None,
        ulysses: CommGroup | None,
        window: int,
        scale: float | None = None,
    ):
        needs = {
            "ring": (True, False),
            "allgather": (True, False),
            "alltoall": (False, True),
            "hybrid": (True, True),
        }
        if impl not in needs or needs[impl] != (ring is not None, ulysses is not None):
            raise ValueError(
                f"cp_impl={impl!r} with ring group {ring} and Ulysses group {ulysses}: ring and allgather need "
                "a ring group only, alltoall a Ulysses group only, hybrid both"
            )
        self.comm, self.ulysses = comm, ulysses
        passes = {"ring": RingPass, "hybrid": RingPass, "allgather": GatherPass}
        self.inner = passes[impl](comm, ring, window, scale) if impl in passes else LocalPass(window, scale)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, docs_BS: Tensor | None = None) -> Tensor:
        return self.with_lse(q, k, v, want_lse=False, docs_BS=docs_BS)[0]

    def with_lse(
        self, q: Tensor, k: Tensor, v: Tensor, want_lse: bool = True, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(output, and with want_lse the log-sum-exp [B, H, S/cp] of this rank's queries)."""
        q, k, v = one_dtype(q, k, v)
        if self.ulysses is not None:
            q, k, v = self._to_heads(q), self._to_heads(k), self._to_heads(v)
        out, lse = BlockwiseAttention.apply(q, k, v, self.inner, docs_BS)
        if self.ulysses is None:
            return out, lse
        # Exchanged as [B, S, H, Dh], so the whole-heads result needs no copy before the projection.
        out = self.comm.all_to_all(out.transpose(1, 2), self.ulysses, split_dim=1, concat_dim=2).transpose(
            1, 2
        )
        if want_lse:
            lse = self.comm.all_to_all_tensor(lse.contiguous(), self.ulysses, split_dim=2, concat_dim=1)
        return out, lse if want_lse else None

    def _to_heads(self, x_BHSD: torch.Tensor) -> torch.Tensor:
        """Sequence-split, all heads -> whole (ring share of the) sequence, 1/ulysses of the heads.
        Key/value heads fewer than the ranks are replicated first; their gradients sum back."""
        u, heads = self.ulysses.size, x_BHSD.shape[1]
        if heads % u:
            x_BHSD = x_BHSD.repeat_interleave(u // heads, dim=1)
        return self.comm.all_to_all(x_BHSD, self.ulysses, split_dim=1, concat_dim=2)


def apply_context_parallel(
    model: Transformer,
    comm: Comm,
    cp: CommGroup,
    impl: CpImpl,
    seq_len: int,
    ring: CommGroup | None = None,
    ulysses: CommGroup | None = None,
) -> SequenceLayout | None:
    """The context-parallel step of `parallelize`: every attention exchanges K/V (or heads) over cp and
    every MoE layer sums its routing statistics over cp. Returns where this rank's tokens of a sequence
    of `seq_len` sit (None for cp = 1). `ring`, `ulysses`: hybrid's two subgroups of cp."""
    if cp.size == 1:
        return None
    ring = {"ring": cp, "allgather": cp, "alltoall": None}.get(impl, ring)
    ulysses = {"ring": None, "allgather": None, "alltoall": cp}.get(impl, ulysses)
    window = model.cfg.sliding_window
    for _, block in model.blocks():
        scale = block.attention.scale
        block.attention.attend = ContextParallelAttention(comm, impl, ring, ulysses, window, scale)
        if block.moe is not None:
            block.moe.token_sum = lambda stats: comm.all_reduce(stats, cp)
    return SequenceLayout(seq_len, ring.size if ring else 1, ulysses.size if ulysses else 1)
