"""Muon on the transformer blocks' matrices, AdamW on the rest, each matrix orthogonalized once.

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") replaces a hidden
matrix's update by the nearest semi-orthogonal matrix to its momentum, found by a few Newton-Schulz
steps. Per matrix W of A x B, with gradient G, momentum μ and learning rate γ (torch.optim.Muon's
order of operations, which this matches exactly on one device):

  1  B <- B + (1 − μ)(G − B)                 momentum (elementwise)
  2  U <- G + μ(B − G) with Nesterov, else B  the update's direction (elementwise)
  3  X <- bf16(U), transposed if A > B, X <- X / max(‖X‖_F, eps)
     k times:  S <- X Xᵀ;  X <- a·X + (b·S + c·S·S)·X      the quintic φ(x) = a x + b x³ + c x⁵ applied
                                                          to X's singular values: U Σ Vᵀ -> U φᵏ(Σ) Vᵀ
  4  W <- W·(1 − γλ) − γ·r(A, B)·X           decoupled weight decay; r: "original" √max(1, A/B),
                                              "match_rms_adamw" 0.2·√max(A, B) (one lr for both groups)

Steps 1, 2 and 4 are elementwise, so each rank does them on the rows it owns, whatever the layout. Step 3
needs the whole matrix: X Xᵀ mixes every row. So within the group of ranks that hold pieces of the
matrices (ZeRO's and FSDP's shard group; DDP's replicas, which hold them whole), each matrix gets one
owner, chosen to balance the Newton-Schulz FLOPs (4·m²·n + 2·m³ per step, m ≤ n its sides):

  sharded (ZeRO-1/2/3)   all-to-all: every rank sends its rows of U (bf16, as step 3 casts) to each
                         matrix's owner; owners orthogonalize; all-to-all: each rank gets its rows back
  whole (DDP)            owners orthogonalize what they hold; all-to-all: each sends its results to
                         the other ranks

An expert tensor [E, A, B] is E matrices; data parallel shards it by whole experts, so each rank
orthogonalizes the experts it holds, without communication. The result is bit-for-bit the one-device
result: the owner runs the same operations on the same whole matrix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import TrainingConfig
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.train.optim import build_optimizer

# torch.optim.Muon's quintic (Jordan et al. 2024): the coefficients that maximise the slope at zero.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

# Inside a transformer block (the model's and the MTP module's); the router and the shared experts' gate
# (scores, not hidden features) stay with AdamW.
_BLOCK_MATRIX = re.compile(r"^(layers\.\d+|mtp\.\d+\.block)\.")
_GATES = re.compile(r"\.(router|shared_gate)\.")


def is_muon_matrix(name: str, ndim: int) -> bool:
    """Whether parameter `name` (of `ndim` dims) is trained by Muon: a 2-D weight (or a 3-D stack of
    experts' matrices) inside a transformer block, but not the router or the shared experts' gate. Embeddings, the head, norms,
    biases and MTP's projection take AdamW."""
    return ndim >= 2 and bool(_BLOCK_MATRIX.match(name)) and not _GATES.search(name)


def newton_schulz(
    u: torch.Tensor,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """The orthogonalization of one matrix (step 3 of the module docstring) in `dtype`: in bf16 it is
    torch.optim.Muon's, operation for operation."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    tall = u.shape[0] > u.shape[1]
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(rule: str, rows: int, cols: int) -> float:
    """r(A, B) of step 4: the update's scale for a matrix of `rows` x `cols`."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-adds x 2 of `steps` Newton-Schulz steps on a rows x cols matrix (m <= n its sides)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "match_rms_adamw"
    ns_dtype: str = "bf16"  # "fp32": Newton-Schulz in fp32 (layouts then agree to fp32 rounding)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.ns_dtype == "fp32" else torch.bfloat16


@dataclass
class _Matrix:
    """One logical matrix of a Muon parameter: the parameter entry, and which expert (3-D) it is."""

    entry: OwnedRows
    expert: int | None  # row of a 3-D expert stack; None: a 2-D matrix split in rows over the group
    owner: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.entry.shape[-2:])  # type: ignore[return-value]


def assign_owners(shapes: list[tuple[int, int]], size: int, steps: int) -> list[int]:
    """Each matrix's owner among `size` ranks: the largest Newton-Schulz work first, each to the least
    loaded rank so far (ties to the lowest rank), the same on every rank."""
    load, owners = [0] * size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_flops(*shapes[i], steps), i)):
        owner = min(range(size), key=lambda r: (load[r], r))
        owners[i], load[owner] = owner, load[owner] + newton_schulz_flops(*shapes[i], steps)
    return owners


class MatrixExchange:
    """Steps 3's communication for the 2-D matrices of one group: who owns each, and the two all-to-alls
    (rows of U to the owners, rows of the orthogonalized X back), or with whole copies (DDP) the one."""

    def __init__(
        self,
        matrices: list[_Matrix],
        comm: Comm,
        group: CommGroup | None,
        sharded: bool,
        settings: MuonSettings,
    ):
        self.matrices, self.comm, self.group, self.sharded = matrices, comm, group, sharded
        steps, self.steps, self.dtype = settings.ns_steps, settings.ns_steps, settings.dtype
        size = group.size if group is not None else 1
        self.size, self.rank = size, group.rank if group is not None else 0
        for m, owner in zip(matrices, assign_owners([m.shape for m in matrices], size, steps), strict=True):
            m.owner = owner

    def rows_of(self, m: _Matrix, rank: int) -> tuple[int, int]:
        """The rows of `m` that `rank` holds: its row block (sharded), or all of them."""
        rows = m.shape[0]
        if not self.sharded:
            return 0, rows
        per = -(-rows // self.size)
        start = min(rank * per, rows)
        return start, min(rows, start + per)

    def _sizes(self, to_owner: bool) -> tuple[list[int], list[int]]:
        """(input splits, output splits), in elements, of the exchange towards the owners or back; whole
        copies (DDP) send nothing to or from oneself."""
        send, receive, me = [0] * self.size, [0] * self.size, self.rank
        for m in self.matrices:
            cols = m.shape[1]

            def count(rank: int, m: _Matrix = m, cols: int = cols) -> int:
                start, stop = self.rows_of(m, rank)
                return (stop - start) * cols

            for j in range(self.size):
                if to_owner:
                    send[j] += count(me) if m.owner == j else 0
                    receive[j] += count(j) if m.owner == me else 0
                elif self.sharded or j != me:
                    send[j] += count(j) if m.owner == me else 0
                    receive[j] += count(me) if m.owner == j else 0
        return send, receive

    def orthogonalize(self, updates: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each matrix's rows that this rank holds, orthogonalized (in the Newton-Schulz dtype); `updates`: this rank's rows of
        each matrix's U, in `matrices` order."""
        whole: dict[int, torch.Tensor] = {}
        if self.sharded and self.size > 1:
            whole = self._gather(updates)
        else:
            whole = {
                i: u
                for i, (m, u) in enumerate(zip(self.matrices, updates, strict=True))
                if m.owner == self.rank
            }
        done = {i: newton_schulz(u, self.steps, self.dtype) for i, u in whole.items()}
        if self.size == 1:
            return [done[i] for i in range(len(self.matrices))]
        return self._scatter(done, updates)

    def _gather(self, updates: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The all-to-all of rows of U to their owners; the owned matrices, assembled whole."""
        send, receive = self._sizes(to_owner=True)
        order = sorted(range(len(self.matrices)), key=lambda i: self.matrices[i].owner)  # by destination
        flat = (
            torch.cat([updates[i].to(self.dtype).reshape(-1) for i in order])
            if order
            else updates[0].new_empty(0)
        )
        got = self.comm.all_to_all_single(flat, self.group, receive, send).split(receive)
        mine = [i for i, m in enumerate(self.matrices) if m.owner == self.rank]
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        for j, chunk in enumerate(got):
            offset = 0
            for i in mine:
                rows = self.rows_of(self.matrices[i], j)
                n = (rows[1] - rows[0]) * self.matrices[i].shape[1]
                pieces[i].append(chunk[offset : offset + n].view(-1, self.matrices[i].shape[1]))
                offset += n
        return {i: torch.cat(parts) for i, parts in pieces.items()}

    def _scatter(
        self, done: dict[int, torch.Tensor], updates: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """The all-to-all of the orthogonalized rows back to the ranks that hold them."""
        send, receive = self._sizes(to_owner=False)
        parts = []
        for j in range(self.size):
            for i in sorted(done):
                if self.sharded or j != self.rank:
                    rows = self.rows_of(self.matrices[i], j)
                    parts.append(done[i][rows[0] : rows[1]].reshape(-1))
        like = updates[0] if updates else torch.empty(0)
        flat = torch.cat(parts) if parts else like.new_empty(0, dtype=self.dtype)
        got = self.comm.all_to_all_single(flat, self.group, receive, send).split(receive)
        out: list[torch.Tensor | None] = [None] * len(self.matrices)
        for j, chunk in enumerate(got):
            offset = 0
            for i, m in enumerate(self.matrices):
                if m.owner != j or (not self.sharded and j == self.rank):
                    continue
                rows = self.rows_of(m, self.rank)
                n = (rows[1] - rows[0]) * m.shape[1]
                out[i] = chunk[offset : offset + n].view(-1, m.shape[1])
                offset += n
        for i, x in done.items():
            if not self.sharded:
                out[i] = x
        return out


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the block matrices, AdamW with the run's settings on the rest: one optimizer to the loop.

    Args:
        entries: what this rank holds of every parameter (the engine's `owned_rows`).
        comm: the counted collectives.
        group: the ranks holding pieces of each dense matrix (`engine.matrix_group()`); None: alone.
        sharded: whether they hold row blocks (ZeRO, FSDP) or whole copies (DDP).
        lr, betas, eps, weight_decay: the run's; the learning-rate schedule sets every group's lr.
        settings: Muon's momentum, Nesterov, Newton-Schulz steps and lr rule.
    """

    def __init__(
        self,
        entries: list[OwnedRows],
        comm: Comm,
        group: CommGroup | None,
        sharded: bool,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        settings: MuonSettings,
    ) -> None:
        muon = [e for e in entries if is_muon_matrix(e.name, len(e.shape))]
        self.adamw = build_optimizer(
            [e.param for e in entries if not is_muon_matrix(e.name, len(e.shape))],
            lr,
            betas,
            eps,
            weight_decay,
        )
        groups = list(self.adamw.param_groups)
        if muon:
            groups.append(
                {"params": [e.param for e in muon], "lr": lr, "weight_decay": weight_decay, "muon": True}
            )
        super().__init__(groups, {})
        self.adamw.state = self.state  # one state dict: checkpoints and metrics read `optimizer.state`
        self.settings = settings
        matrices = [_Matrix(e, None) for e in muon if len(e.shape) == 2]
        self.exchange = MatrixExchange(matrices, comm, group, sharded, settings)
        for m in matrices:
            if self.exchange.rows_of(m, self.exchange.rank) != (m.entry.start, m.entry.start + m.entry.rows):
                raise ValueError(f"{m.entry.name}: the engine's rows are not the row blocks Muon expects")
        self.experts = [e for e in muon if len(e.shape) == 3]
        self._muon = {id(e.param) for e in muon}

    def fresh_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state `param` has before its first step: Muon's momentum, or AdamW's step and moments
        (what a checkpoint saves, and loads into)."""
        if id(param) in self._muon:
            return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}
        zeros = [torch.zeros_like(param, memory_format=torch.preserve_format) for _ in range(2)]
        return {"step": torch.tensor(0.0), "exp_avg": zeros[0], "exp_avg_sq": zeros[1]}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        self.adamw.step()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group["params"], group["lr"], group["weight_decay"])

    def _momentum(self, p: nn.Parameter) -> torch.Tensor:
        """Steps 1 and 2 on the rows this rank holds: the momentum, and the update's direction U."""
        s = self.settings
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - s.momentum)
        return grad.lerp(buf, s.momentum) if s.nesterov else buf

    def _muon_step(self, params: list[nn.Parameter], lr: float, weight_decay: float) -> None:
        s = self.settings
        updates = {id(p): self._momentum(p) for p in params}
        matrices = self.exchange.matrices
        rows_u = [updates[id(m.entry.param)][: m.entry.rows] for m in matrices]
        for m, x in zip(matrices, self.exchange.orthogonalize(rows_u), strict=True):
            self._apply(
                m.entry.param.data, m.entry.rows, x, lr, weight_decay, lr_ratio(s.adjust_lr, *m.shape)
            )
        for e in self.experts:  # whole experts on every rank that holds them: no exchange
            u, ratio = updates[id(e.param)], lr_ratio(s.adjust_lr, *e.shape[-2:])
            for k in range(e.rows):
                self._apply(
                    e.param.data[k], None, newton_schulz(u[k], s.ns_steps, s.dtype), lr, weight_decay, ratio
                )

    @staticmethod
    def _apply(
        w: torch.Tensor,
        rows: int | None,
        x: torch.Tensor | None,
        lr: float,
        weight_decay: float,
        ratio: float,
    ) -> None:
        """Step 4 on `w` (its first `rows` rows hold the matrix; the rest is padding)."""
        w.mul_(1 - lr * weight_decay)
        if x is not None:
            (w if rows is None else w[:rows]).add_(x, alpha=-lr * ratio)


def make_optimizer(engine: DataParallelEngine, comm: Comm, t: TrainingConfig) -> torch.optim.Optimizer:
    """The run's optimizer over what `engine` gives it: AdamW, or Muon with AdamW (training.optimizer)."""
    betas = (t.beta1, t.beta2)
    if t.optimizer == "adamw":
        return build_optimizer(engine.optimizer_params(), t.lr, betas, t.eps, t.weight_decay)
    group, sharded = engine.matrix_group()
    settings = MuonSettings(
        t.muon_momentum, t.muon_nesterov, t.muon_ns_steps, t.muon_adjust_lr, t.muon_ns_dtype
    )
    return MuonWithAdamW(
        engine.owned_rows(), comm, group, sharded, t.lr, betas, t.eps, t.weight_decay, settings
    )
