"""The interface every data-parallel engine implements: all the training loop calls.

An engine owns the model's parameters for the optimizer (whole, or this rank's row shards), decides when
gradients are reduced, and reports what each rank holds so that checkpoints and parity checks can see
the logical tensors. The engines: DDP (`ddp.py`), ZeRO-1/2 (`zero.py`), ZeRO-3/FSDP and PyTorch's
`fully_shard` (`fsdp.py`); `parallel/data_parallel.py` picks one for a layout.

Per step the loop calls, in order:

  prepare_micro_batch(is_last)   before each micro-batch's forward (the last one synchronises)
  finish_gradients()             after the last backward: every reduction waited for
  grad_norm_sq_parts / scale_grads_   exact clipping over the rows this rank owns
  optimizer.step() on optimizer_params()
  after_step()                   e.g. start all-gathering the updated shards (forward waits for them)
  zero_grad()
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.row_blocks import block_box

# Elements per float64 partial sum: the float64 copy of a piece (2 MiB) stays in cache, so the exact
# norm costs about 1.9x fp32's (4M elements: 7.2 against 3.9 ms here) and never a float64 copy of a
# whole gradient.
NORM_PIECE = 1 << 18


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The sum of every element's square, in float64 (a 0-d tensor).

    A float32 reduction over millions of elements is off by about 1e-5 relative (measured: 1.8e-4 for 4M
    elements in one tensor), and by a different amount for each way the elements are split over ranks, so
    the clipping norm depended on the layout. Squares of float32 (or bf16) values are exact in float64 and
    their float64 sum is off by ~1e-14, whatever the order: every layout gets the same norm once it is
    rounded to float32. Tensors are cut into NORM_PIECE-element pieces (views) so that no float64 copy of
    a large gradient exists."""
    pieces = [
        p for t in tensors for p in (t.reshape(-1).split(NORM_PIECE) if t.numel() > NORM_PIECE else (t,))
    ]
    if not pieces:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(pieces, dtype=torch.float64)).square().sum()


@dataclass(frozen=True, kw_only=True)
class OwnedRows:
    """Rows [start, start + rows) of logical parameter `name` (of `shape`), held by this rank in the
    first `rows` rows of the optimizer's tensor `param` (any rows after them are padding). The rows are
    those of `row_shape` when the engine cut a stack of matrices within them (config/row_blocks.py:
    `param` is then [rows, *row_shape[1:]]); `box` says where they sit in `shape` either way."""

    name: str
    param: nn.Parameter
    start: int
    rows: int
    shape: tuple[int, ...]
    row_shape: tuple[int, ...] = ()  # empty: `shape`

    @property
    def rows_shape(self) -> tuple[int, ...]:
        return self.row_shape or self.shape

    def box(self) -> tuple[list[int], list[int]]:
        """(offsets, sizes) in `shape` of the rows held."""
        return block_box(self.shape, self.rows_shape, self.start, self.rows)

    def held(self, t: torch.Tensor) -> torch.Tensor:
        """The held rows of `t` (`param` or a tensor shaped like it) at the box's sizes, a view."""
        return t[: self.rows].view(self.box()[1]) if self.row_shape else t[: self.rows]


class DataParallelEngine:
    """What the training loop needs from a data-parallel strategy."""

    model: nn.Module
    # The group whose ranks own disjoint rows of the parameters, and its DeviceMesh (None: every rank
    # holds whole parameters).
    shard: CommGroup | None = None
    shard_mesh: Any = None
    # The group over which partial gradient-norm sums are added up (None: nothing to add up).
    norm_group: CommGroup | None = None

    def owned_rows(self) -> list[OwnedRows]:
        """What this rank holds of every logical parameter, for checkpoints that any layout can read."""
        raise NotImplementedError

    def matrix_group(self) -> tuple[CommGroup | None, bool]:
        """The ranks holding pieces of each dense parameter, and whether each holds a row block of it
        (True) or the whole of it (False): where work done once per matrix is shared out (Muon)."""
        return self.shard, True

    def load_owned_rows(self) -> None:
        """Called after a checkpoint has been loaded into `owned_rows()` (e.g. to refresh full copies)."""

    def full_gradients(self, comm: Comm) -> dict[str, torch.Tensor]:
        """Every logical parameter's gradient at its logical shape (gathered from the owning ranks), as
        the single-device run would have it: what parity checks compare."""
        out = {}
        for entry in self.owned_rows():
            grad = entry.param.grad
            if grad is None:
                grad = torch.zeros_like(entry.param)
            if hasattr(grad, "full_tensor"):  # a DTensor (PyTorch's FSDP)
                out[entry.name] = grad.full_tensor().detach().clone()
                continue
            if self.shard is None or self.shard.size == 1:
                out[entry.name] = grad.detach().clone()
                continue
            rows_shape = entry.rows_shape
            per_rank = -(-rows_shape[0] // self.shard.size)
            padded = grad.new_zeros((per_rank, *rows_shape[1:]))
            padded[: entry.rows] = grad[: entry.rows]
            whole = comm.all_gather_tensor(padded, self.shard)[: rows_shape[0]]
            out[entry.name] = whole.reshape(entry.shape).clone()
        return out

    def optimizer_params(self) -> list[nn.Parameter]:
        """The tensors the optimizer updates (whole parameters or this rank's shards)."""
        raise NotImplementedError

    def prepare_micro_batch(self, is_last: bool) -> None:
        """Called before each micro-batch's forward; gradients are synchronised on the last one."""
        raise NotImplementedError

    def finish_gradients(self) -> None:
        """Wait for every reduction; afterwards the optimizer params' `.grad` hold the global gradient."""
        raise NotImplementedError

    def chunk_backward(self, chunk: nn.Module, defers_weights: bool) -> AbstractContextManager:
        """What the pipeline runs `chunk`'s backward (B) in; `defers_weights`: its linear layers' weight
        gradients come later (W, split backward), needing no parameters. Nothing but for ZeRO-3."""
        return contextlib.nullcontext()

    def grad_norm_sq_parts(
        self, whole_on_every_tp_rank: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()
    ) -> torch.Tensor:
        """[split, whole]: sums of squares of the gradient elements this rank owns (each owned by one rank
        of `norm_group`), for parameters split over tensor parallel ranks and for those every tp rank
        holds whole (and so must be counted once, not tp times). Parameters in `skip` are left out."""
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for entry in self.owned_rows():
            grad = entry.param.grad
            if grad is None or entry.name in skip:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad[: entry.rows]
            parts[entry.name in whole_on_every_tp_rank].append(local)
        device = next((g.device for part in parts for g in part), None)
        return torch.stack([sum_of_squares(part, device) for part in parts])

    def scale_grads_(self, coef: torch.Tensor) -> None:
        grads = [p.grad for p in self.optimizer_params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient storage the engine keeps besides the parameters' `.grad` (for memory accounting)."""
        return []

    def after_step(self) -> None:
        """Called after the optimizer step (e.g. to start all-gathering updated shards)."""

    def expect_grad_uses(self, param: nn.Parameter, uses: int) -> None:
        """`param`'s gradient accumulates in `uses` separate backward calls per micro-batch (an engine
        that reduces when a gradient is final waits for all of them)."""

    def finish_params(self) -> None:
        """Whole parameters current now (an engine may finish its post-step gathers in the next forward)."""

    def zero_grad(self) -> None:
        raise NotImplementedError
