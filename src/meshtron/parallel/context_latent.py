"""Context parallel over multi-head latent attention's latents (`parallel.cp_exchange = "latent"`).

MLA's keys and values are up-projected from one latent per token (models/latent_attention.py): the
normalised c [C = kv_lora_rank] and the rotated rotary key k_rot [R = qk_rope_head_dim], which every
head shares. So instead of every head's keys and values (H·(N + R + Dv) values per token on a tensor-
parallel rank), a rank can send its tokens' latents (C + R values) and let each receiver up-project them
with wkv_b itself:

  exchange     per hop (ring) or gathered once (allgather): [c, k_rot] [B, S/cp, C + R]
  on arrival   [k_nope, v] = c·Wᵀ per head (this rank's heads: wkv_b is column-parallel under tp),
               k = [k_nope, k_rot]; the block as parallel/context.py computes it
  backward     the ring again: each block's keys and values up-projected again from the latents, its
               dK, dV turned back into a latent gradient (dc = [dk_nope, dv]·W, dk_rot = Σ_heads dk_rot)
               that travels home with the ring (allgather: reduce-scattered), and W's gradient summed
               over the blocks on this rank (cp ranks sum it with the data-parallel reduction)

Bytes per layer and micro-batch on a rank, forward, with T = B·S/cp tokens and cp − 1 hops (ring):

  kv       T·H·(N + R + Dv)·(cp − 1)·element      (DeepSeek-V3, tp 8: 16 heads · 320 = 5,120 values)
  latent   T·(C + R)·(cp − 1)·element                                          (576 values)

and backward the same again plus the fp32 gradients travelling back (dK/dV, or the latent's). What the
latent costs instead: the up-projection of every block that arrives, 2·T·C·H·(N + Dv) FLOPs per hop
forward and three times that backward (rerun, dc, dW). The planner weighs the two (plan/comm_time.py);
`cp_exchange = "auto"` takes its choice. The memory kept for backward shrinks too: the latents, not every
head's keys and values. Ulysses and hybrid exchanges split heads, not tokens, and keep the keys and values.
A float8 run up-projects the blocks in its compute dtype, not in float8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.models.blockwise_attention import (
    block_backward,
    block_forward,
    docs_at,
    heads_last_in_memory,
    one_dtype,
)
from meshtron.models.llama import Transformer
from meshtron.parallel.context import GatherPass, RingHop, RingPass


@dataclass(frozen=True)
class LatentShape:
    """How a latent [.., C + R] and wkv_b's rows [H·(N + Dv)] split: MLA's head sizes."""

    nope: int  # N
    rope: int  # R
    v_dim: int  # Dv

    def up(self, latent_BSL: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys [B, H, S, N + R] and values [B, H, S, Dv] from the latents."""
        B, S, L = latent_BSL.shape
        c, k_rot = latent_BSL.split([L - self.rope, self.rope], dim=-1)
        kv = torch.matmul(c, w.to(c.dtype).t()).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rot[:, None].expand(-1, kv.shape[1], -1, -1)], dim=-1), v

    def down(self, dk: Tensor, dv: Tensor, latent_BSL: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """(the latents' gradient [B, S, C + R], W's gradient [H·(N + Dv), C]) from the keys' and values'
        gradients of one block, in fp32."""
        B, H, S, _ = dk.shape
        dk_nope, dk_rot = dk.split([self.nope, self.rope], dim=-1)
        d_kv = torch.cat([dk_nope, dv], dim=-1).transpose(1, 2).reshape(B, S, -1)  # [B, S, H·(N + Dv)]
        c = latent_BSL[..., : latent_BSL.shape[-1] - self.rope].float()
        dc = torch.matmul(d_kv, w.float())
        dw = torch.matmul(d_kv.flatten(0, 1).t(), c.flatten(0, 1))
        return torch.cat([dc, dk_rot.sum(1)], dim=-1), dw


@dataclass
class LatentRingPass(RingPass):
    """Ring attention passing latents (the module docstring); `blocks` and `exposed_s` as RingPass's."""

    shape: LatentShape | None = None

    def forward(
        self, q: Tensor, latent: Tensor, w: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        def up(latent_j: Tensor, keys: slice) -> tuple[Tensor, Tensor]:
            return self.shape.up(latent_j[:, keys], w)

        return self.ring_forward(q, latent, up, self.shape.v_dim, docs_BS)

    def backward(
        self, saved: tuple[Tensor, ...], dout: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        q, latent, w, out, lse = saved
        n, r, S = self.group.size, self.group.rank, q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        d_latent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)  # rank r's own, at i = 0
        accumulator: RingHop | None = None
        for i in range(n):
            flight = RingHop(self.comm, self.group, latent) if i < n - 1 else None
            block = self.block(r, (r - i) % n, S, docs_BS)
            grads = None
            if block is not None:
                rows, keys, q_pos, k_pos, docs = block
                k, v = self.shape.up(latent[:, keys], w)
                outs = (out[:, :, rows], lse[:, :, rows], dout[:, :, rows])
                grads = block_backward(
                    q[:, :, rows], k, v, q_pos, k_pos, *outs, self.window, docs=docs, scale=self.scale
                )
                dq[:, :, rows] += grads[0]
            if accumulator is not None:  # rank j's latent gradient, arriving from the previous rank
                d_latent = self.land(accumulator)
            if grads is not None:
                d_keys, dw_block = self.shape.down(grads[1], grads[2], latent[:, keys], w)
                d_latent[:, keys] += d_keys
                dw += dw_block
            accumulator = RingHop(self.comm, self.group, d_latent)  # home after n hops
            if flight is not None:
                latent = self.land(flight)
        return dq, self.land(accumulator), dw


@dataclass
class LatentGatherPass(GatherPass):
    """All-gather attention gathering latents: one up-projection of the whole sequence per layer."""

    shape: LatentShape | None = None

    def gathered_latents(self, latent: Tensor) -> Tensor:
        """The whole sequence's latents [B, S, C + R] in position order."""
        rank_major = self.comm.all_gather_tensor(latent[None], self.group, dim=0)  # [n, B, S/n, C + R]
        return torch.cat(self._chunks(rank_major), dim=-2)

    def forward(
        self, q: Tensor, latent: Tensor, w: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        positions = self.positions(q)
        k, v = self.shape.up(self.gathered_latents(latent), w)
        docs = docs_at(docs_BS, *positions)
        return block_forward(q, k, v, *positions, self.window, docs=docs, scale=self.scale)

    def backward(
        self, saved: tuple[Tensor, ...], dout: Tensor, docs_BS: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        q, latent, w, out, lse = saved
        positions, whole = self.positions(q), self.gathered_latents(latent)
        k, v = self.shape.up(whole, w)
        docs = docs_at(docs_BS, *positions)
        dq, dk, dv = block_backward(
            q, k, v, *positions, out, lse, dout, self.window, docs=docs, scale=self.scale
        )
        d_whole, dw = self.shape.down(dk, dv, whole, w)
        n, S = self.group.size, q.shape[2]
        rank_major = torch.empty((n, *d_whole.shape[:-2], S, d_whole.shape[-1]), device=q.device)
        for view, chunk in zip(self._chunks(rank_major), d_whole.split(S // 2, dim=-2), strict=True):
            view.copy_(chunk)
        d_latent = self.comm.reduce_scatter_tensor(rank_major, self.group, dim=0)[0]
        return dq, d_latent, dw


class LatentBlockwiseAttention(torch.autograd.Function):
    """Autograd around a latent pass: forward keeps q, the latents, W, the output and the log-sum-exp;
    backward asks the pass for dQ, the latents' gradient and W's."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, latent: Tensor, w: Tensor, attention_pass: Any, docs_BS: Tensor | None
    ) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the passes choose their own precision
            out, lse = attention_pass.forward(q, latent, w, docs_BS)
        out = heads_last_in_memory(out, q.dtype)
        ctx.save_for_backward(q, latent, w, out, lse)
        ctx.attention_pass, ctx.docs_BS = attention_pass, docs_BS
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Any, ...]:
        q, latent, w, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, d_latent, dw = ctx.attention_pass.backward((q, latent, w, out, lse), dout, ctx.docs_BS)
        return dq.to(q.dtype), d_latent.to(latent.dtype), dw.to(w.dtype), None, None


class LatentContextParallelAttention:
    """What `LatentAttention.latent_attend` becomes under cp with cp_exchange = "latent": rotated q [B, H,
    S/cp, N + R], this rank's latents c [B, S/cp, C] and rotated k_rot [B, 1, S/cp, R], wkv_b's weight
    (this rank's heads) in, this rank's attention output [B, H, S/cp, Dv] out."""

    def __init__(
        self, comm: Comm, impl: str, ring: CommGroup, window: int, scale: float | None, shape: LatentShape
    ):
        if impl not in ("ring", "allgather"):
            raise ValueError(f"cp_exchange='latent' runs the ring and allgather exchanges, not {impl!r}")
        kind = LatentRingPass if impl == "ring" else LatentGatherPass
        self.inner = kind(comm, ring, window, scale, shape=shape)

    def __call__(
        self, q: Tensor, c_BSC: Tensor, k_rot_B1SR: Tensor, w: Tensor, docs_BS: Tensor | None = None
    ) -> Tensor:
        q, c, k_rot = one_dtype(q, c_BSC, k_rot_B1SR[:, 0])
        return LatentBlockwiseAttention.apply(q, torch.cat([c, k_rot], dim=-1), w, self.inner, docs_BS)


def apply_latent_exchange(model: Transformer, comm: Comm, cp: CommGroup, impl: str) -> None:
    """With `parallel.cp_exchange = "latent"`, after `apply_context_parallel`: every latent attention
    passes its latents over cp (ring or all-gather) instead of its keys and values."""
    m = model.cfg
    if cp.size == 1 or not m.is_mla:
        return
    shape = LatentShape(m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    for _, block in model.blocks():
        attention = block.attention
        attention.latent_attend = LatentContextParallelAttention(
            comm, impl, cp, m.sliding_window, attention.scale, shape
        )
