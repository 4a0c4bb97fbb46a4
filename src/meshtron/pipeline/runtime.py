"""Pipeline runtime: executes this rank's action list from schedules.py on real tensors.

The model is built whole (so every parameter starts from its layout-independent value) and pruned to
the chunks this rank holds. A forward keeps what its backward needs (the chunk's output, the received
input); sends are non-blocking and waited on at the end of the step; receives block. Each micro-batch's
loss is divided by the global token count, so the sum over micro-batches is the step's mean loss.

With the zero-bubble schedule, B computes only the gradient of the chunk's input (keeping the graph)
and W the parameters' gradients from the same graph; here W runs autograd through the chunk a second
time, restricted to the parameters, so the split costs compute (a true per-op split is future work).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtron.comm import Comm, CommGroup, Pending
from meshtron.models.llama import Transformer, rope_cos_sin
from meshtron.pipeline.schedules import build_schedule
from meshtron.pipeline.split import chunks_of_rank, split_layers


class PipelineRuntime:
    def __init__(self, model: Transformer, comm: Comm, pp: CommGroup, vpp: int, schedule: str):
        self.model, self.comm, self.pp, self.vpp, self.schedule = model, comm, pp, vpp, schedule
        self.n_chunks = pp.size * vpp
        self.chunks = chunks_of_rank(pp.rank, pp.size, vpp)
        layers = split_layers(model.cfg.n_layers, self.n_chunks)
        self.layers_of = {c: [str(i) for i in layers[c]] for c in self.chunks}
        keep = {name for c in self.chunks for name in self.layers_of[c]}
        for name in list(model.layers):
            if name not in keep:
                del model.layers[name]
        if 0 not in self.chunks:
            model.tok_embeddings = None
        if self.n_chunks - 1 not in self.chunks:
            model.norm = None
            model.output = None

    def chunk_params(self, chunk: int) -> list[nn.Parameter]:
        model = self.model
        modules: list[nn.Module] = [model.layers[name] for name in self.layers_of[chunk]]
        if chunk == 0:
            modules.append(model.tok_embeddings)
        if chunk == self.n_chunks - 1:
            modules += [model.norm, model.output]
        return [p for m in modules for p in m.parameters()]

    def chunk_forward(self, chunk: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.model
        h = model.tok_embeddings(x) if chunk == 0 else x
        cos, sin = rope_cos_sin(model.rope_inv_freq, positions, h.dtype)
        aux = torch.zeros((), device=h.device)
        for name in self.layers_of[chunk]:
            h, block_aux = model.layers[name](h, cos, sin)
            if block_aux is not None:
                aux = aux + block_aux
        if chunk == self.n_chunks - 1:
            h = model.output(model.norm(h))
        return h, aux

    def run(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        global_tokens: int,
        token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        autocast: Callable[[], object],
    ) -> torch.Tensor:
        """One step's forwards and backwards; returns this rank's share of the mean cross-entropy
        (non-zero on the rank holding the last chunk only)."""
        last = self.n_chunks - 1
        actions = build_schedule(self.pp.size, self.vpp, len(micro_batches), self.schedule)[self.pp.rank]
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {}
        input_grads: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[tuple[Pending, torch.Tensor]] = []
        ce_sum = torch.zeros(())
        tokens0, _ = micro_batches[0]
        shape = (tokens0.shape[0], tokens0.shape[1], self.model.cfg.dim)
        positions = torch.arange(tokens0.shape[1]).expand(tokens0.shape[0], -1)
        for a in actions:
            key = (a.chunk, a.mb)
            tokens, targets = micro_batches[a.mb]
            if a.kind == "RECV_F":
                inputs[key] = self.comm.recv(shape, torch.float32, "cpu", self.pp, a.peer).requires_grad_(
                    True
                )
            elif a.kind == "F":
                x = tokens if a.chunk == 0 else inputs[key]
                with autocast():
                    out, aux = self.chunk_forward(a.chunk, x, positions)
                share = targets.numel() / global_tokens
                if a.chunk == last:
                    ce = token_loss(out, targets).sum() / global_tokens
                    ce_sum += ce.detach()
                    outputs[key] = ([ce + aux.float() * share], [None])
                elif aux.requires_grad:  # an MoE chunk: its aux loss is back-propagated here too
                    outputs[key] = ([out, aux.float() * share], [None, torch.ones(())])
                else:
                    outputs[key] = ([out], [None])
            elif a.kind == "SEND_F":
                tensor = outputs[key][0][0].detach().float().contiguous()
                sends.append((self.comm.isend(tensor, self.pp, a.peer), tensor))
            elif a.kind == "RECV_B":
                grad = self.comm.recv(shape, torch.float32, "cpu", self.pp, a.peer)
                roots, grads = outputs[key]
                outputs[key] = (roots, [grad, *grads[1:]])
            elif a.kind == "B":
                roots, grads = outputs[key]
                if self.schedule != "zero_bubble":
                    torch.autograd.backward(roots, grads)
                    outputs.pop(key)
                    if a.chunk > 0:
                        input_grads[key] = inputs.pop(key).grad
                elif a.chunk > 0:  # input gradient now, parameters' gradients at W
                    (input_grads[key],) = torch.autograd.grad(roots, [inputs[key]], grads, retain_graph=True)
            elif a.kind == "W":
                roots, grads = outputs.pop(key)
                torch.autograd.backward(roots, grads, inputs=self.chunk_params(a.chunk))
                inputs.pop(key, None)
            elif a.kind == "SEND_B":
                tensor = input_grads.pop(key).contiguous()
                sends.append((self.comm.isend(tensor, self.pp, a.peer), tensor))
        for pending, _ in sends:
            pending.wait()
        return ce_sum
