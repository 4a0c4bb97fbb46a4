"""Data parallel with expert parallel: dense and expert parameters reduced over different groups.

Dense parameters are the same on every data- and context-parallel rank, so their gradients reduce (and
ZeRO/FSDP shard them) over dp_shard x cp, and all-reduce across dp_replicate, as without experts. An
expert's weights live only on the ranks holding that expert: the same position in every ep group, i.e.
the expert-data-parallel group edp (x dp_replicate). Its gradient there already sums what every ep
rank's tokens contributed (the dispatch's backward brought them), and each rank's loss is divided by
the global token count, so reducing it with a plain sum over edp x dp_replicate gives exactly the
single-device gradient. Averaging over edp, or summing over dp_shard x cp, would be off by a factor of
ep: the classic bug this split avoids (tests/test_expert_parallel.py checks the scale).

Each group gets its own engine of the kind the layout asks for (DDP when edp = 1, else ZeRO-1/2 or FSDP
over edp, HSDP across dp_replicate); `ExpertDataParallel` drives the two as one. Gradient clipping adds
both engines' squared sums over dp_shard x cp = edp x ep, which counts every element once: dense rows
once per shard, expert rows once per edp shard of each ep rank's distinct experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.engines.engine import DataParallelEngine, OwnedRows


class ParameterSubset:
    """Some of a model's parameters, read the way the engines read a model's (`named_parameters`)."""

    def __init__(self, model: nn.Module, names: frozenset[str], keep: bool):
        self.named = [(n, p) for n, p in model.named_parameters() if (n in names) == keep]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named)


class ExpertDataParallel(DataParallelEngine):
    """The dense parameters' engine and the experts' engine, driven as one."""

    def __init__(
        self, model: nn.Module, dense: DataParallelEngine, experts: DataParallelEngine, ep: CommGroup
    ):
        self.model, self.dense, self.experts, self.ep = model, dense, experts, ep
        self.shard, self.shard_mesh, self.norm_group = dense.shard, dense.shard_mesh, dense.norm_group
        self.engines = (dense, experts)

    def owned_rows(self) -> list[OwnedRows]:
        return self.dense.owned_rows() + self.experts.owned_rows()

    def matrix_group(self) -> tuple[CommGroup | None, bool]:
        return self.dense.matrix_group()  # the dense matrices' (experts' are whole on their ranks)

    def load_owned_rows(self) -> None:
        for engine in self.engines:
            engine.load_owned_rows()

    def full_gradients(self, comm: Comm) -> dict[str, torch.Tensor]:
        """Every parameter's gradient at its shape before expert parallel (the ep ranks' experts stacked)."""
        grads = self.dense.full_gradients(comm)
        for name, grad in self.experts.full_gradients(comm).items():
            grads[name] = comm.all_gather_tensor(grad.contiguous(), self.ep)
        return grads

    def optimizer_params(self) -> list[nn.Parameter]:
        return self.dense.optimizer_params() + self.experts.optimizer_params()

    def prepare_micro_batch(self, is_last: bool) -> None:
        for engine in self.engines:
            engine.prepare_micro_batch(is_last)

    def finish_gradients(self) -> None:
        for engine in self.engines:
            engine.finish_gradients()

    @contextlib.contextmanager
    def chunk_backward(self, chunk: nn.Module, defers_weights: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.chunk_backward(chunk, defers_weights))
            yield

    def grad_norm_sq_parts(
        self, whole_on_every_tp_rank: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()
    ) -> torch.Tensor:
        return sum(e.grad_norm_sq_parts(whole_on_every_tp_rank, skip) for e in self.engines)

    def scale_grads_(self, coef: torch.Tensor) -> None:
        for engine in self.engines:
            engine.scale_grads_(coef)

    def grad_buffers(self) -> list[torch.Tensor]:
        return self.dense.grad_buffers() + self.experts.grad_buffers()

    def after_step(self) -> None:
        for engine in self.engines:
            engine.after_step()

    def expect_grad_uses(self, param: nn.Parameter, uses: int) -> None:
        self.dense.expect_grad_uses(param, uses)

    def finish_params(self) -> None:
        for engine in self.engines:
            engine.finish_params()

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()
