"""Pipeline runtime: executes this rank's action list from schedules/build.py on real tensors.

The model is built whole (so every parameter starts from its layout-independent value) and pruned to
the chunks this rank holds (`split_pipeline`, the first step of `parallelize`) before tensor parallel
shards what is left; rules/pipeline.py states what the split and the schedule need of the config. Each chunk
is a `PipelineChunk` module over the model's own blocks, so data-parallel hooks (FSDP gathers) fire
around it. A forward keeps what its backward needs (the graph from the received input to the chunk's
output); sends are non-blocking, and once one has finished the sent output's own storage is released
(its values are not needed for backward); receives block. Each micro-batch's loss is divided by
the global token count, so the sum over micro-batches is the step's mean loss.

Gradient synchronisation: before every action that accumulates parameter gradients the runtime calls
`before_grads(is_last)`, `is_last` being true for the chunk's last such action of the step, which is
what the data-parallel engines take as "the last micro-batch" (DDP and ZeRO-1 then reduce that chunk's
buckets while the pipeline goes on; ZeRO-2/3 reduce every micro-batch anyway).

Tied embeddings: the first stage (embedding) and the last (head) each hold a copy of the one matrix;
after the step's backward their gradients are summed over the `pp_ends` group (`sum_tied_gradients`),
so the two copies take identical optimizer steps and stay equal. Under a V schedule both ends are
chunks of rank 0, which holds the one matrix.

V schedules hand a micro-batch from chunk pp - 1 to chunk pp on the same rank: the "send" keeps the
output (as fp32, as a message would arrive) for the "receive", which starts the next chunk's graph from
it; the input gradient goes back the same way.

With a split-backward schedule (zero-bubble, zbv, dualpipev), the linear layers of every chunk but the
first defer their weight gradients from B to W (zero_bubble.py). The first chunk's B is its whole
backward, as in 1F1B, and its W empty (deferred, it would all land at the step's end).
With `overlap` (dualpipev), each F&B pair runs its forward in a second thread during its backward (pairs.py).

Evaluation (`forward_only`) needs no schedule: forwards only, in one global order every rank follows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.pending import Pending
from meshtron.comm.timing import TIMES
from meshtron.config.schema import SPLIT_BACKWARD, PipelineSchedule
from meshtron.engines.engine import DataParallelEngine
from meshtron.models.documents import MicroBatchLayout
from meshtron.models.llama import Transformer
from meshtron.models.loss import StepLoss
from meshtron.pipeline.chunk import PipelineChunk, keep_rank_chunks, shares_embedding
from meshtron.pipeline.pairs import run_pair
from meshtron.pipeline.zero_bubble import DeferWeightGrads
from meshtron.schedules.actions import ACTION_PHASES, Action, Kind, action_span, chunks_of_rank, rank_of_chunk
from meshtron.schedules.build import build_schedule, busy_seconds, send_release_points

TIED_WEIGHT = "tok_embeddings.weight"
# What a chunk's backward (B) runs in, given the chunk and whether its weight gradients are deferred to W
ChunkBackward = Callable[[nn.Module, bool], AbstractContextManager]


def sum_tied_gradients(engine: DataParallelEngine, comm: Comm, ends: CommGroup) -> None:
    """Add up the tied embedding/head gradient of the first and last stage (whatever rows of it this
    rank owns: both stages shard the matrix the same way over data parallel)."""
    for entry in engine.owned_rows():
        if entry.name == TIED_WEIGHT and entry.param.grad is not None:
            grad = entry.param.grad
            comm.all_reduce_(grad.to_local() if hasattr(grad, "to_local") else grad, ends)


class ReceiveAhead:
    """Posts receives ahead, one per peer, in the order that peer sends (from the schedule), so that a
    message lands while the rank computes rather than when it asks for it. A rank may need a peer's
    messages in another order than they were sent (a V schedule interleaves activations and gradients
    between the same two ranks); messages that arrive before they are needed wait in `arrived`. Point-
    to-point messages between two ranks are matched in the order they are issued (NCCL has no tags)."""

    def __init__(
        self,
        comm: Comm,
        pp: CommGroup,
        schedule: list[list[Action]],
        shape: tuple[int, ...],
        device: torch.device,
    ):
        self.comm, self.pp, self.shape, self.device = comm, pp, shape, device
        me = pp.rank
        # Per peer, what it sends this rank, in its order: (carries, sending chunk, mb).
        self.expected = {
            peer: [(a.kind.carries, a.chunk, a.mb) for a in actions if a.kind.is_send and a.peer == me][::-1]
            for peer, actions in enumerate(schedule)
            if peer != me
        }
        self.posted: dict[int, tuple[tuple[Kind, int, int], Pending, torch.Tensor]] = {}
        self.arrived: dict[tuple[Kind, int, int], torch.Tensor] = {}
        for peer in self.expected:
            self._post_next(peer)

    def _post_next(self, peer: int) -> None:
        if self.expected[peer]:
            key = self.expected[peer].pop()
            pending, buffer = self.comm.irecv(self.shape, torch.float32, self.device, self.pp, peer)
            self.posted[peer] = (key, pending, buffer)

    def take(self, a: Action) -> torch.Tensor:
        """The message receive `a` takes (waiting for it, and for the peer's earlier ones, if need be)."""
        key = (a.kind.carries, a.source_chunk, a.mb)
        while key not in self.arrived:
            got, pending, buffer = self.posted.pop(a.peer)
            pending.wait()
            self.arrived[got] = buffer
            self._post_next(a.peer)
        return self.arrived.pop(key)


@dataclass
class Send:
    """A non-blocking send in flight: its buffer, and the stage output it was taken from (None for a
    gradient) to release once it is done."""

    pending: Pending
    buffer: torch.Tensor
    output: torch.Tensor | None
    key: tuple[int, int]


class _Step:
    """One step's actions on real tensors: what each forward keeps for its backward, what is in flight."""

    def __init__(
        self,
        runtime: PipelineRuntime,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        loss: StepLoss,
        before_grads: Callable[[bool], None],
        layouts: list[MicroBatchLayout] | None = None,
        chunk_backward: ChunkBackward = lambda chunk, defers: contextlib.nullcontext(),
    ):
        self.rt, self.micro_batches, self.loss, self.before_grads = runtime, micro_batches, loss, before_grads
        self.chunk_backward = chunk_backward
        schedule = build_schedule(
            runtime.pp.size, runtime.vpp, len(micro_batches), runtime.schedule, paired=runtime.overlap
        )
        self.actions = schedule[runtime.pp.rank]
        self.settled_by = send_release_points(schedule, runtime.pp.rank)
        self.split = runtime.schedule in SPLIT_BACKWARD
        self.local: dict[tuple[Kind, int, int], torch.Tensor] = {}  # hand-offs to this rank's own chunk
        # Each chunk's last B and last W of the step: after them its gradients (of that kind) are final.
        self.last_of = {
            (a.kind, a.chunk): i for i, a in enumerate(self.actions) if a.kind in (Kind.B, Kind.W)
        }
        self.deferred: dict[tuple[int, int], DeferWeightGrads] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        # What each forward's backward starts from: graph edges (not tensors) and their gradients.
        self.outputs: dict[tuple[int, int], tuple[list[GradientEdge], list[torch.Tensor | None]]] = {}
        self.unsent: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.sends: list[Send] = []
        tokens0, _ = micro_batches[0]
        batch, seq = tokens0.shape
        self.device = tokens0.device
        self.ce_sum = torch.zeros((), device=self.device)
        self.layouts = runtime.explicit(layouts, len(micro_batches), batch, seq, self.device)
        shape = (batch, seq // runtime.seq_shards, runtime.model.cfg.dim)
        self.receiver = ReceiveAhead(runtime.comm, runtime.pp, schedule, shape, self.device)
        self.handlers = {
            Kind.RECV_F: self.recv_forward,
            Kind.F: self.forward,
            Kind.SEND_F: self.send_forward,
            Kind.RECV_B: self.recv_backward,
            Kind.B: self.backward,
            Kind.W: self.weight_grads,
            Kind.SEND_B: self.send_backward,
        }

    def _take(self, a: Action) -> torch.Tensor:
        if a.peer == self.rt.pp.rank:
            return self.local.pop((a.kind.carries, a.source_chunk, a.mb))
        return self.receiver.take(a)

    def recv_forward(self, index: int, a: Action) -> None:
        self.inputs[a.chunk, a.mb] = self._take(a).requires_grad_(True)

    def forward(self, index: int, a: Action) -> None:
        key, last = (a.chunk, a.mb), self.rt.n_chunks - 1
        tokens, targets = self.micro_batches[a.mb]
        x = tokens if a.chunk == 0 else self.inputs[key]
        defer = DeferWeightGrads() if self.split and a.chunk > 0 else contextlib.nullcontext()
        with defer, self.loss.autocast():
            out, aux = self.rt.chunks[a.chunk](x, *self.layouts[a.mb][:3])
        if self.split and a.chunk > 0:
            self.deferred[key] = defer
        one = torch.ones((), device=self.device)
        if a.chunk == last:
            loss, ce = self.loss.of(out, aux, targets, a.mb, self.layouts[a.mb].mtp_targets)
            self.ce_sum += ce.detach()
            roots, grads = [loss], [one]
        else:
            self.unsent[key] = out
            roots, grads = [out], [None]
            if aux.requires_grad:  # an MoE chunk: its aux loss is back-propagated here too
                roots, grads = [out, self.loss.aux_share(aux, targets)], [None, one]
        self.outputs[key] = ([get_gradient_edge(r) for r in roots], grads)

    def send_forward(self, index: int, a: Action) -> None:
        out = self.unsent.pop((a.chunk, a.mb))
        tensor = out.detach().float().contiguous()
        if a.peer == self.rt.pp.rank:
            self.local[Kind.F, a.chunk, a.mb] = tensor
            return
        self.sends.append(Send(self.rt.comm.isend(tensor, self.rt.pp, a.peer), tensor, out, (a.chunk, a.mb)))

    def recv_backward(self, index: int, a: Action) -> None:
        grad = self._take(a)
        roots, grads = self.outputs[a.chunk, a.mb]
        self.outputs[a.chunk, a.mb] = (roots, [grad, *grads[1:]])

    def backward(self, index: int, a: Action) -> None:
        key = (a.chunk, a.mb)
        roots, grads = self.outputs.pop(key)
        self.before_grads(self.last_of[Kind.B, a.chunk] == index)
        deferred = self.deferred.get(key)
        with (
            deferred or contextlib.nullcontext(),
            self.chunk_backward(self.rt.chunks[a.chunk], bool(deferred)),
        ):
            torch.autograd.backward(roots, grads)
        if a.chunk > 0:
            self.input_grads[key] = self.inputs.pop(key).grad

    def weight_grads(self, index: int, a: Action) -> None:
        if (a.chunk, a.mb) in self.deferred:  # the first chunk's W is empty: its B did everything
            self.before_grads(self.last_of[Kind.W, a.chunk] == index)
            self.deferred.pop((a.chunk, a.mb)).weight_grads()

    def send_backward(self, index: int, a: Action) -> None:
        tensor = self.input_grads.pop((a.chunk, a.mb)).contiguous()
        if a.peer == self.rt.pp.rank:
            self.local[Kind.B, a.chunk, a.mb] = tensor
            return
        self.sends.append(Send(self.rt.comm.isend(tensor, self.rt.pp, a.peer), tensor, None, (a.chunk, a.mb)))

    def release_sent(self, settled: list[tuple[int, int]]) -> None:
        """Drop the buffers of finished sends: those the backend reports done (NCCL does) and those the
        last receive proved taken (`settled`, from the schedule). A sent stage output's values are not
        needed by its backward (which starts from the graph edge and the received gradient), so its
        storage is released too: only the graph's saved tensors stay until the backward."""
        still = []
        for send in self.sends:
            if send.key not in settled and not send.pending.completed():
                still.append(send)
                continue
            send.pending.wait()
            if send.output is not None:
                send.output.data = torch.empty(0, dtype=send.output.dtype, device=send.output.device)
                self.rt.released_outputs += 1
        self.sends = still


class PipelineRuntime:
    def __init__(
        self,
        model: Transformer,
        comm: Comm,
        pp: CommGroup,
        vpp: int,
        schedule: PipelineSchedule,
        layer_split: list[list[int]],
        seq_shards: int = 1,
        overlap: bool = False,
    ):
        """`model` already pruned to this rank's chunks of `layer_split` (`split_pipeline`);
        `seq_shards`: activations between stages hold 1/seq_shards of the sequence (sequence parallel);
        `overlap`: run DualPipeV's F&B pairs at once (pairs.py; `comm` must have its pair lane)."""
        self.model, self.comm, self.pp, self.vpp, self.schedule = model, comm, pp, vpp, schedule
        self.seq_shards, self.overlap = seq_shards, overlap
        if overlap and not comm.has_pair_lane():
            raise ValueError(
                "overlapping pipeline pairs needs the comm layer's pair lane (Comm.add_pair_lane)"
            )
        self.n_chunks = pp.size * vpp
        self.chunks = {
            c: PipelineChunk(model, c, layer_split[c], self.n_chunks)
            for c in chunks_of_rank(pp.rank, pp.size, vpp, schedule)
        }
        # Per compute action of the last step: (action, start, end) in seconds from the step's start.
        self.timeline: list[tuple[Action, float, float]] = []
        # Every communication wait of the last step: (op, group, lane, start, end), seconds likewise.
        self.comm_timeline: list[tuple[str, str, str, float, float]] = []
        self.step_seconds = 0.0

    def explicit(
        self, layouts: list[MicroBatchLayout] | None, n: int, batch: int, seq: int, device: torch.device
    ) -> list[MicroBatchLayout]:
        """Each micro-batch's (RoPE positions, document ids or None), positions 0..S-1 where None."""
        default = torch.arange(seq, device=device).expand(batch, -1)
        given = layouts or [MicroBatchLayout(None, None)] * n
        return [layout._replace(rope=default if layout.rope is None else layout.rope) for layout in given]

    def boundary_chunks(self) -> list[PipelineChunk]:
        """The chunks of this rank holding the embedding or the head (both, on rank 0 of a V)."""
        return [c for c in self.chunks.values() if c.holds_non_block_params()]

    def holds_tied_weight(self) -> bool:
        return shares_embedding(self.model.cfg) and self.model.tok_embeddings is not None

    def tied_across_ranks(self) -> bool:
        """This rank holds one of two copies of a tied embedding (its gradient is summed with the other)."""
        return self.holds_tied_weight() and not {0, self.n_chunks - 1} <= set(self.chunks)

    def embedding_grad_calls(self) -> int:
        """The separate backward calls that give this rank's embedding table (or its copy) a gradient per
        micro-batch: chunk 0's B (its lookup); in the last chunk, the MTP depths' lookup in B and the tied
        head in that B too or, under a split backward, in W (zero_bubble.py: linear weights' gradients)."""
        m, last = self.model.cfg, self.n_chunks - 1
        calls = {(0, "B")} if 0 in self.chunks else set()
        if last in self.chunks:
            calls |= {(last, "B")} if m.mtp_depth else set()
            split = self.schedule in SPLIT_BACKWARD and last > 0
            calls |= {(last, "W" if split else "B")} if m.tie_embeddings else set()
        return len(calls)

    def is_last_stage(self) -> bool:
        return self.n_chunks - 1 in self.chunks

    def counted_elsewhere(self) -> frozenset[str]:
        """Parameters of this rank whose gradient another stage counts in the norm: the last stage's copy
        of a tied embedding (the first stage counts it)."""
        counted = self.tied_across_ranks() and self.is_last_stage()
        return frozenset({TIED_WEIGHT} if counted else ())

    def run(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        loss: StepLoss,
        before_grads: Callable[[bool], None] = lambda is_last: None,
        layouts: list[MicroBatchLayout] | None = None,
        chunk_backward: ChunkBackward = lambda chunk, defers: contextlib.nullcontext(),
    ) -> torch.Tensor:
        """One step's forwards and backwards; returns this rank's share of the mean cross-entropy
        (non-zero on the rank holding the last chunk only). `before_grads(is_last)` runs before every
        action that accumulates parameter gradients, true for the chunk's last such action of the step;
        `chunk_backward(chunk, defers_weights)`: what each B runs in (DataParallelEngine's).
        `layouts`: each micro-batch's RoPE positions (the tokens' global ones under context parallel;
        None: 0..S-1) and document ids (None without a document mask)."""
        step = _Step(self, micro_batches, loss, before_grads, layouts, chunk_backward)
        self.released_outputs = 0
        self.timeline = []
        self.step_start = time.perf_counter()
        ran_with_pair: set[int] = set()
        with self.comm.recording(spans=True) as recorded:
            for index, a in enumerate(step.actions):
                step.release_sent(step.settled_by.get(index - 1, []))
                if index in ran_with_pair:
                    continue
                if a.paired and self.overlap:
                    ran_with_pair.update(self._run_pair(step, index))
                else:
                    self._timed(step, index)
            for send in step.sends:
                send.pending.wait()
        self.step_seconds = time.perf_counter() - self.step_start
        start = self.step_start
        self.comm_timeline = [(*what, s - start, e - start) for *what, s, e in recorded.spans or []]
        return step.ce_sum

    def _timed(self, step: _Step, index: int) -> None:
        a, start = step.actions[index], time.perf_counter()
        span = action_span(a)
        with TIMES.phase(ACTION_PHASES[a.kind], span) if a.kind.is_compute else TIMES.span(span):
            step.handlers[a.kind](index, a)
        if a.kind.is_compute:
            self.timeline.append((a, start - self.step_start, time.perf_counter() - self.step_start))

    def _run_pair(self, step: _Step, index: int) -> list[int]:
        """The paired F at `index` in a helper thread on the pair lane, while the B and W after it run
        here (pairs.py); returns their indices."""
        later = [i for i in range(index + 1, len(step.actions)) if step.actions[i].kind.is_compute][:2]
        forward, backward = (
            (lambda: self._timed(step, index)),
            (lambda: [self._timed(step, i) for i in later]),
        )
        run_pair(self.comm, forward, backward, step.device)
        return later

    @torch.no_grad()
    def forward_only(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        loss: StepLoss,
        layouts: list[MicroBatchLayout] | None = None,
    ) -> torch.Tensor:
        """Forwards only (evaluation): this rank's share of the micro-batches' summed cross-entropy, as
        `run` returns it (non-zero on the rank holding the last chunk only; no aux loss, no backward).

        No schedule is needed without backwards: every rank walks the same global order (micro-batch,
        then chunk) and acts on the chunks it holds, receiving a chunk's input from the rank of the chunk
        before and sending its output on. A receive's send comes earlier in that order and sends do not
        block, so no rank waits on one that waits on it. The last step's timeline is left as it was."""
        tokens0, _ = micro_batches[0]
        batch, seq = tokens0.shape
        device = tokens0.device
        layouts = self.explicit(layouts, len(micro_batches), batch, seq, device)
        shape, last = (batch, seq // self.seq_shards, self.model.cfg.dim), self.n_chunks - 1
        ce_sum, sends, rank_of = torch.zeros((), device=device), [], self._rank_of
        for mb, (tokens, targets) in enumerate(micro_batches):
            out = None
            for c, chunk in sorted(self.chunks.items()):
                if c == 0:
                    x = tokens
                elif rank_of(c - 1) == self.pp.rank:  # the V's turn: the chunk before is this rank's
                    x = out.float()
                else:
                    pending, x = self.comm.irecv(shape, torch.float32, device, self.pp, rank_of(c - 1))
                    pending.wait()
                with loss.autocast():
                    out, aux = chunk(x, *layouts[mb][:3])
                if c == last:
                    ce_sum += loss.of(out, aux, targets, mb)[1]
                elif rank_of(c + 1) != self.pp.rank:
                    buffer = out.float().contiguous()
                    sends.append((self.comm.isend(buffer, self.pp, rank_of(c + 1)), buffer))
        for pending, _ in sends:
            pending.wait()
        return ce_sum

    def _rank_of(self, chunk: int) -> int:
        return rank_of_chunk(chunk, self.pp.size, self.schedule)

    def idle_fraction(self) -> float:
        """This rank's share of the last step's pipeline time spent not computing (waiting or sending)."""
        return 1 - busy_seconds(self.timeline) / self.step_seconds


def split_pipeline(
    model: Transformer, pp: CommGroup, layer_split: list[list[int]], vpp: int, schedule: PipelineSchedule
) -> None:
    """The pipeline step of `parallelize`: keep this rank's chunks of `layer_split` (the layers of each of
    the pp·vpp chunks), before the other steps, so that they shard only what is kept."""
    keep_rank_chunks(model, chunks_of_rank(pp.rank, pp.size, vpp, schedule), layer_split)
