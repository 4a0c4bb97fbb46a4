"""Muon on the transformer blocks' matrices, AdamW on the rest, each matrix orthogonalized once.

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") replaces a hidden
matrix's update by the nearest semi-orthogonal matrix to its momentum, found by a few Newton-Schulz
steps. Per matrix W of A x B, with gradient G, momentum μ and learning rate γ (torch.optim.Muon's
order of operations, which this matches exactly on one device):

  1  B <- B + (1 − μ)(G − B)                 momentum (elementwise)
  2  U <- G + μ(B − G) with Nesterov, else B  the update's direction (elementwise)
  3  X <- U in bf16 (or fp32), transposed if A > B, X <- X / max(‖X‖_F, eps)
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

  tensor parallel        a second level for the matrices tp cuts: among the tp ranks holding the pieces
                         (each a data-parallel owner's), a tp owner gathers them along the cut dim

An expert tensor [E, A, B] is E matrices; data parallel shards it by whole experts, so each rank
orthogonalizes the experts it holds (through the tp level where tp cuts them). The result is the
one-device result: the owner runs the same operations on the same whole matrix (train/muon_exchange.py
moves the pieces; docs/muon.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.optimizer import is_muon_matrix
from meshtron.config.schema import Config
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.parallel.tensor import TensorParallelPlan
from meshtron.train.muon_exchange import MatrixExchange, Piece
from meshtron.train.optim import build_optimizer

# torch.optim.Muon's quintic (Jordan et al. 2024): the coefficients that maximise the slope at zero.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


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


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "match_rms_adamw"
    ns_dtype: str = "bf16"  # "fp32": Newton-Schulz in fp32 (layouts then agree to fp32 rounding)
    bucket_mb: float = 25.0  # the exchange's buckets (parallel.bucket_mb)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.ns_dtype == "fp32" else torch.bfloat16


@dataclass(frozen=True)
class MatrixGroups:
    """Where the pieces of the dense matrices are: the data-parallel group (`engine.matrix_group()`)
    and whether its ranks hold row blocks (ZeRO, FSDP) or whole copies (DDP); tensor parallel's group
    and the dim it cuts each parameter along (`TensorParallelPlan.split_dims`)."""

    dp: CommGroup | None = None
    dp_split: bool = True
    tp: CommGroup | None = None
    split_dims: dict[str, tuple[int, int] | None] = field(default_factory=dict)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the block matrices, AdamW with the run's settings on the rest: one optimizer to the loop.

    Args:
        entries: what this rank holds of every parameter (the engine's `owned_rows`).
        comm: the counted collectives.
        groups: where the matrices' pieces are (data and tensor parallel).
        lr, betas, eps, weight_decay: the run's; the learning-rate schedule sets every group's lr.
        settings: Muon's momentum, Nesterov, Newton-Schulz steps and lr rule.
    """

    def __init__(
        self,
        entries: list[OwnedRows],
        comm: Comm,
        groups: MatrixGroups,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        settings: MuonSettings,
    ) -> None:
        muon = [e for e in entries if is_muon_matrix(e.name, len(e.shape))]
        rest = [e.param for e in entries if not is_muon_matrix(e.name, len(e.shape))]
        self.adamw = build_optimizer(rest, lr, betas, eps, weight_decay)
        groups_ = list(self.adamw.param_groups)
        if muon:
            groups_.append(
                {"params": [e.param for e in muon], "lr": lr, "weight_decay": weight_decay, "muon": True}
            )
        super().__init__(groups_, {})
        self.adamw.state = self.state  # one state dict: checkpoints and metrics read `optimizer.state`
        self.settings, self.split_dims = settings, groups.split_dims
        self._muon = {id(e.param) for e in muon}
        self._plan(muon, comm, groups)

    def _plan(self, muon: list[OwnedRows], comm: Comm, groups: MatrixGroups) -> None:
        """The two levels: data-parallel blocks of each tp-local matrix to a dp owner, then, for the
        matrices tp cuts, the dp owners' tp-local pieces to a tp owner (experts: tp alone, as each rank
        holds whole experts of its data-parallel shard)."""
        s = self.settings
        device = muon[0].param.device if muon else torch.device("cpu")
        self.flat = [e for e in muon if len(e.shape) == 2]
        self.experts = [e for e in muon if len(e.shape) == 3]
        if any(e.row_shape for e in muon):  # engines built with DataParallelSettings.cut_within
            raise ValueError("Muon needs each expert's matrix whole on one rank: build without cut_within")

        def exchange(pieces: list[Piece], group: CommGroup | None, split: bool) -> MatrixExchange:
            return MatrixExchange(pieces, comm, group, split, s.dtype, s.ns_steps, device)

        self.dp = exchange([Piece(e.name, tuple(e.shape)) for e in self.flat], groups.dp, groups.dp_split)
        for e, piece in zip(self.flat, self.dp.pieces, strict=True):
            if self.dp.block(piece, self.dp.rank) != (e.start, e.start + e.rows):
                raise ValueError(f"{e.name}: the engine's rows are not the row blocks Muon expects")
        owned = set(self.dp.owned())
        self.tp_flat = [i for i, e in enumerate(self.flat) if i in owned and self.split_dims.get(e.name)]
        self.tp_index = {i: k for k, i in enumerate(self.tp_flat)}  # flat index -> tp piece
        self.bucket_elements = int(s.bucket_mb * 2**20) // s.dtype.itemsize
        self.tp_experts = [(e, k) for e in self.experts if self.split_dims.get(e.name) for k in range(e.rows)]
        pieces = [
            Piece(self.flat[i].name, self.logical(self.flat[i]), self.cut(self.flat[i])) for i in self.tp_flat
        ]
        pieces += [Piece(f"{e.name}[{k}]", self.logical(e), self.cut(e) - 1) for e, k in self.tp_experts]
        self.tp = exchange(pieces, groups.tp, True)

    def cut(self, entry: OwnedRows) -> int:
        """The dim tensor parallel cuts `entry` along."""
        return self.split_dims[entry.name][0]  # type: ignore[index]

    def logical(self, entry: OwnedRows) -> tuple[int, int]:
        """The whole matrix's shape: tp's cut dim at its logical size (an expert stack: each expert's)."""
        shape = list(entry.shape)
        split = self.split_dims.get(entry.name)
        if split is not None:
            shape[split[0]] = split[1]
        return tuple(shape[-2:])  # type: ignore[return-value]

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

    def _orthogonalized(self, updates: dict[int, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict]:
        """Step 3 for every matrix, bucket by bucket (the next bucket's rows travel while this one's
        Newton-Schulz runs): this rank's rows of each 2-D matrix's result by index in `flat`, and each
        tp-cut expert slice's by (entry id, expert)."""
        blocks = {i: updates[id(e.param)][: e.rows] for i, e in enumerate(self.flat)}
        buckets = self.dp.buckets(self.bucket_elements)
        arriving = self.dp.gather_async(buckets[0], blocks) if buckets else None
        scatters = []
        for k, bucket in enumerate(buckets):
            whole = arriving()  # type: ignore[misc]
            if k + 1 < len(buckets):
                arriving = self.dp.gather_async(buckets[k + 1], blocks)
            cut = [i for i in whole if i in self.tp_index]
            done = self._through_tp({self.tp_index[i]: whole[i] for i in cut})
            done = {i: done[self.tp_index[i]] for i in cut}
            done.update({i: self._ns(x) for i, x in whole.items() if i not in self.tp_index})
            scatters.append(self.dp.scatter_async(bucket, done))
        rows = {i: x for finish in scatters for i, x in finish().items()}
        first = len(self.tp_index)
        slices = self._through_tp(
            {first + j: updates[id(e.param)][k] for j, (e, k) in enumerate(self.tp_experts)}
        )
        experts = {(id(e.param), k): slices[first + j] for j, (e, k) in enumerate(self.tp_experts)}
        return rows, experts

    def _through_tp(self, pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This rank's tp pieces (by index in the tp exchange) orthogonalized whole by their tp owners."""
        idx = sorted(pieces)
        whole = self.tp.gather_async(idx, pieces)()
        return self.tp.scatter_async(idx, {i: self._ns(x) for i, x in whole.items()})()

    def _ns(self, x: torch.Tensor) -> torch.Tensor:
        return newton_schulz(x, self.settings.ns_steps, self.settings.dtype)

    def _muon_step(self, params: list[nn.Parameter], lr: float, weight_decay: float) -> None:
        s = self.settings
        updates = {id(p): self._momentum(p) for p in params}
        rows, experts = self._orthogonalized(updates)
        for e, x in zip(self.flat, (rows[i] for i in range(len(self.flat))), strict=True):
            self._apply(e.param.data, e.rows, x, lr, weight_decay, lr_ratio(s.adjust_lr, *self.logical(e)))
        for e in self.experts:  # whole experts of this rank's shard; tp's cut ones came back above
            u, ratio = updates[id(e.param)], lr_ratio(s.adjust_lr, *self.logical(e))
            for k in range(e.rows):
                x = experts.get((id(e.param), k))
                x = newton_schulz(u[k], s.ns_steps, s.dtype) if x is None else x
                self._apply(e.param.data[k], None, x, lr, weight_decay, ratio)

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


def make_optimizer(
    engine: DataParallelEngine, comm: Comm, cfg: Config, tp_plan: TensorParallelPlan | None = None
) -> torch.optim.Optimizer:
    """The run's optimizer over what `engine` gives it: AdamW, or Muon with AdamW (training.optimizer)."""
    t, p = cfg.training, cfg.parallel
    betas = (t.beta1, t.beta2)
    if t.optimizer == "adamw":
        return build_optimizer(engine.optimizer_params(), t.lr, betas, t.eps, t.weight_decay)
    dp, split = engine.matrix_group()
    groups = MatrixGroups(dp, split, *((tp_plan.tp, tp_plan.split_dims) if tp_plan is not None else ()))
    settings = MuonSettings(
        t.muon_momentum, t.muon_nesterov, t.muon_ns_steps, t.muon_adjust_lr, t.muon_ns_dtype, p.bucket_mb
    )
    return MuonWithAdamW(engine.owned_rows(), comm, groups, t.lr, betas, t.eps, t.weight_decay, settings)
