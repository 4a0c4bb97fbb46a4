"""DiLoCo: replicas that train on their own for H steps, then take one outer step together.

Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1).
The replicas are the dp_replicate slices of the mesh; inside one, everything else (dp_shard, tp, pp, cp,
ep, ZeRO) runs as always, and its inner optimizer (AdamW or Muon) steps on gradients averaged over the
replica's own data only (an MoE's balancing bias too steps on the replica's own loads). On an inner step
only two small reductions cross replicas: the loss for the metrics, and the largest clipping norm (every
replica skips a non-finite step or none does).

  after inner step s, when s is a multiple of H, on the rows θ this rank holds (its engine's owned rows),
  a bucket of parallel.bucket_mb at a time:
    Δ      = θ_outer − θ                   the replica's pseudo-gradient
    Δ̄      = mean of Δ over the replicas    one all-reduce over dp_replicate (fp32), every H steps
    v      = μ·v + Δ̄                       outer SGD with Nesterov momentum (torch.optim.SGD's rule)
    θ_outer = θ_outer − η·(Δ̄ + μ·v)
    θ      = θ_outer                        every replica continues from the same weights

η = `fault_tolerance.diloco_outer_lr` (0.7 in the paper) and μ = `diloco_outer_momentum` (0.9). The
inner optimizer's state is each replica's own and is kept across outer steps, as torchft's DiLoCo does.
θ_outer and v are one fp32 copy each of the rows this rank owns (2 x 4 bytes per owned element).

A checkpoint holds every replica's own weights and moments (between outer steps they differ: replica k's
under `name@replicaK`, replica 0's under the plain names that export and init_from read) and θ_outer and v
once; it resumes with the same dp_replicate, any layout inside a replica (checkpoint/save_load.py).

Traffic across replicas: one all-reduce of the owned rows every H steps, against DDP's (or HSDP's) one
per step: 1/H of it, in fp32. What the planner counts: plan/comm.py.
"""

from __future__ import annotations

import math

import torch

from meshtron.checkpoint.save_load import ReplicaState
from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import Dim
from meshtron.config.schema import Config
from meshtron.engines.engine import DataParallelEngine


class OuterStep:
    """The outer loop of DiLoCo over `replicas` (this rank's dp_replicate group).

    Args:
        engine: the replica's data-parallel engine (its owned rows are what this rank updates).
        comm: the counted collectives.
        replicas: the ranks holding the same rows in the other replicas.
        every: H, inner steps per outer step.
        lr, momentum: the outer SGD's η and μ (Nesterov).
        bucket_elements: fp32 elements per all-reduce (parallel.bucket_mb's worth).
    """

    def __init__(
        self,
        engine: DataParallelEngine,
        comm: Comm,
        replicas: CommGroup,
        every: int,
        lr: float,
        momentum: float,
        bucket_elements: int = 25 * 2**18,
    ):
        self.comm, self.replicas = comm, replicas
        self.every, self.lr, self.momentum = every, lr, momentum
        self.params = [e.param for e in engine.owned_rows()]
        # θ_outer (set by `start_from_weights`) and v: fp32, the rows this rank owns
        self.outer = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.velocity = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        # The all-reduce in buckets of about `bucket_elements` (one parameter larger than that alone): the
        # weight changes are formed a bucket at a time, never a whole copy of the rows at once.
        self.buckets: list[list[int]] = [[]]
        for i, p in enumerate(self.params):
            filled = sum(self.params[j].numel() for j in self.buckets[-1])
            if self.buckets[-1] and filled + p.numel() > bucket_elements:
                self.buckets.append([])
            self.buckets[-1].append(i)

    @torch.no_grad()
    def start_from_weights(self) -> None:
        """θ_outer = the initial weights."""
        for outer, p in zip(self.outer, self.params, strict=True):
            outer.copy_(p)

    def tensors(self) -> list[torch.Tensor]:
        """What DiLoCo holds besides the engine and the inner optimizer (for memory accounting)."""
        return [*self.outer, *self.velocity]

    def replica_state(self) -> ReplicaState:
        """What a checkpoint saves of DiLoCo on this rank: its replica's index (whose own weights and moments
        are saved apart) and θ_outer and v, the same in every replica."""
        shared = {
            id(p): {"outer": o, "velocity": v}
            for p, o, v in zip(self.params, self.outer, self.velocity, strict=True)
        }
        return ReplicaState(self.replicas.rank, shared)

    def largest_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The largest of the replicas' clipping norms, a NaN counted as inf (max() may drop a NaN): every
        replica skips a non-finite step or none does."""
        seen = torch.nan_to_num(grad_norm, nan=math.inf)
        return self.comm.all_reduce_(seen, self.replicas, op="max")

    @torch.no_grad()
    def after_inner_step(self, completed: int) -> bool:
        """Called after inner step `completed` (1-based, the global step) on every rank: the outer step
        when it is due, before the engine refreshes what it derives from the owned rows. Returns whether
        it ran."""
        if completed % self.every:
            return False
        for bucket in self.buckets:
            like = self.outer[bucket[0]] if bucket else torch.empty(0)
            flat = like.new_empty(sum(self.params[i].numel() for i in bucket))
            deltas = list(flat.split([self.params[i].numel() for i in bucket]))
            for i, d in zip(bucket, deltas, strict=True):
                torch.sub(self.outer[i].flatten(), self.params[i].flatten(), out=d)
            self.comm.all_reduce_(flat, self.replicas, op="avg")
            for i, d in zip(bucket, deltas, strict=True):
                outer, v, d = self.outer[i], self.velocity[i], d.view_as(self.outer[i])
                v.mul_(self.momentum).add_(d)
                outer.sub_(d.add_(v, alpha=self.momentum), alpha=self.lr)
                self.params[i].copy_(outer)
        return True


def make_outer_step(
    engine: DataParallelEngine, comm: Comm, mesh: ParallelMesh, cfg: Config
) -> OuterStep | None:
    """DiLoCo's outer loop for this run, or None when fault_tolerance.diloco_every is 0."""
    f = cfg.fault_tolerance
    if not f.diloco_every:
        return None
    replicas = mesh.group(Dim.DP_REPLICATE)
    elements = int(cfg.parallel.bucket_mb * 2**20) // 4
    return OuterStep(
        engine, comm, replicas, f.diloco_every, f.diloco_outer_lr, f.diloco_outer_momentum, elements
    )
