"""Training through failures: replica groups that drop out and heal from a live peer (fault_tolerance.enabled).

Each dp_replicate slice of the layout is a replica group: a job of its own, with everything else of the
layout inside it (dp_shard, tp, pp, cp, ep, ZeRO), started and restarted by its own launcher
(commands/replica_launch.py). The groups meet only through torchft (comm/replica_groups.py). A step:

  quorum        the live groups agree to take step s; a restarted group first heals: every one of its
                ranks loads, over the network, the state of the same rank of a live group (`job_state`:
                the rows its engine owns, the optimizer's state, the data position, the RNG, the model's
                buffers such as an MoE's balancing bias), so that it is bit for bit the live groups' copy
  forward       group g trains on its contiguous share g of global batch s (`ReplicaShare`), with the
  backward      loss divided by the targets of the *live* groups' shares (the tokens it would be
                divided by if the dead groups' samples were not in the batch)
  reduce        the gradients the engine leaves on this rank's rows, summed over the live groups (the
                same rows of the same rank in each): the token mean over the live groups' samples;
                the loss and an MoE's expert loads likewise
  vote          every rank of the group agrees that every reduction completed; if not (a peer died
                mid-step) nothing is applied and step s is retried with the new quorum, on the same data
  update        clipping, the optimizer, the balancing bias: identical in every live group

The samples a failure loses are exactly the shares of the groups missing from a step's quorum: each row
of metrics.jsonl says which groups took part (`replicas`). The learning rate follows the global step.
Without a failure every group takes part in every step, and the run is the run without fault tolerance.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from meshtron.checkpoint import CheckpointError
from meshtron.comm.replica_groups import ReplicaGroups, restart_attempt
from meshtron.config.schema import Config, ConfigError
from meshtron.data.dataset import PreparedData
from meshtron.data.sampler import Batch, BatchSampler
from meshtron.train.drills import sigkill_if_healing

GROUP_ENV, LIGHTHOUSE_ENV, STORE_ENV = "MESHTRON_REPLICA_GROUP", "TORCHFT_LIGHTHOUSE", "MESHTRON_FT_STORE"


class ReplicasLost(CheckpointError):
    """Every replica group failed: no live one holds the weights the job had reached."""


def replica_config(cfg: Config) -> Config:
    """What one replica group runs: the layout without dp_replicate, its share of the global batch."""
    p, t = cfg.parallel, cfg.training
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(p, dp_replicate=1),
        training=dataclasses.replace(t, global_batch=t.global_batch // p.dp_replicate),
        fault_tolerance=dataclasses.replace(cfg.fault_tolerance, enabled=False),
    )


class ReplicaShare:
    """The batch sampler of a replica group: its contiguous share `index` of `count` of every global batch
    (the share the group's ranks would take as dp_replicate coordinate `index` of the whole job), with the
    whole job's data position (its state_dict is the whole job's sampler's)."""

    def __init__(self, sampler: BatchSampler, index: int, count: int):
        self.sampler, self.index, self.count = sampler, index, count

    @property
    def step(self) -> int:
        return self.sampler.step

    @step.setter
    def step(self, value: int) -> None:
        self.sampler.step = value

    def next_micro_batches(
        self, dataset: PreparedData, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        at, of = self.index * dp_size + dp_rank, self.count * dp_size
        return self.sampler.next_micro_batches(dataset, at, of, micro_batch)

    def counted_targets(self, dataset: PreparedData, step: int, part: tuple[int, int] = (0, 1)) -> int | None:
        """The counted targets of this group's share (`part` is not used: the share is the group's)."""
        return self.sampler.counted_targets(dataset, step, (self.index, self.count))

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def job_state(job: Any) -> dict[str, Any]:
    """What a live group serves a healing one, on this rank: references, read while the step's forward
    and backward run (torchft's transport holds the optimizer step back until every read is done)."""
    state = {
        "rows": [e.param.detach() for e in job.parallel.engine.owned_rows()],
        "optimizer": job.optimizer.state_dict(),
        "sampler": job.sampler.state_dict(),
        "buffers": [b.detach() for b in job.model.buffers()],
        "rng": torch.get_rng_state(),
    }
    if job.place.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(job.place.device)
    return state


@torch.no_grad()
def load_job_state(job: Any, state: dict[str, Any]) -> None:
    """Heal this rank from a live group's `job_state` (on every rank of the group at once)."""
    sigkill_if_healing(job.replicas.global_rank(job.place.rank))
    engine = job.parallel.engine
    for entry, rows in zip(engine.owned_rows(), state["rows"], strict=True):
        entry.param.copy_(rows)
    job.optimizer.load_state_dict(state["optimizer"])
    job.sampler.load_state_dict(state["sampler"])
    for buffer, value in zip(job.model.buffers(), state["buffers"], strict=True):
        buffer.copy_(value)
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], job.place.device)
    engine.load_owned_rows()  # e.g. ZeRO-1/2's whole parameters gathered again from the healed rows


class FaultTolerance:
    """A replica group's part in each step (the table above), on one rank.

    Args:
        job: this group's job (set up from `replica_config`).
        groups: the torchft side (comm/replica_groups.py).
        cfg: the whole job's config (what checkpoints and records keep).
    """

    def __init__(self, job: Any, groups: ReplicaGroups, cfg: Config):
        self.job, self.groups, self.cfg = job, groups, cfg
        self.index, self.count = groups.index, groups.count
        self.bucket_elements = max(1, int(cfg.parallel.bucket_mb * 2**20) // 4)
        self.live_ids: list[int] = []
        self.first_step, self.retried, self.idle, self.live_before = True, False, False, self.count

    def global_rank(self, rank: int) -> int:
        """Ranks are numbered group by group: group g's rank r is g x (ranks per group) + r."""
        return self.index * self.job.place.world_size + rank

    def begin(self, step: int) -> int:
        """The quorum for step `step` (0-based); returns the step the live groups are at, which a group
        that healed jumps to. Refuses a restarted group that found no live group to heal from."""
        first, self.first_step = self.first_step, False
        if first:
            self.groups.set_step(step)
            if restart_attempt() == 0:
                self.groups.wait_for_every_group()
        reached = self.groups.job_step() if first else -1
        if reached >= self.cfg.training.steps:  # the live groups finished while this one restarted
            return self._finished(reached)
        started = time.perf_counter()
        at = self.groups.start_step(step)
        self.say_quorum(step, at, time.perf_counter() - started)
        if first and restart_attempt() > 0 and at < reached:
            # Alone: the live groups may have taken the job's last step while this one asked for a quorum.
            reached = self.groups.job_step()
            if reached >= self.cfg.training.steps:
                return self._finished(reached)
            lost = ReplicasLost(
                f"it restarted at step {at}, but the job had reached step {reached} and no replica group "
                "is left that holds it (every group failed); restart the job from its newest checkpoint "
                "with --checkpoint.resume=true (checkpoint.every keeps one)"
            )
            self.groups.report_fatal(str(lost))
            raise lost
        self.job.sampler.step = at
        return at

    def _finished(self, reached: int) -> int:
        """A restarted group that found the job done: it takes no step and ends well."""
        self.idle = True
        self.say(f"replica group {self.index} restarted after the job's last step; nothing left to do")
        return reached

    def say(self, line: str) -> None:
        if self.job.place.rank == 0:
            print(f"meshtron: {line}", flush=True)

    def say_quorum(self, step: int, at: int, seconds: float) -> None:
        """A line when this group healed (in `seconds`, the quorum's), when the last step was not taken,
        and when the groups change."""
        if at > step:
            self.say(
                f"replica group {self.index} healed from a live group: weights, optimizer state and data "
                f"position after step {at}, over the network in {seconds:.2f} s"
            )
        if self.retried:
            self.say(f"step {step + 1} taken again: a replica group failed during it")
        live = self.groups.live()
        if live != self.live_before and not (at > step):
            self.say(
                f"replica group {self.index}: {live} of {self.count} replica groups live from step {at + 1}"
            )
        self.live_before, self.retried = live, False

    def loss_divisor(self, own: int | None) -> tuple[int, int]:
        """(the targets this step's loss is divided by, the tokens MoE auxiliary losses are shared over):
        the live groups' shares' (`own`: this group's counted targets, None when every target counts)."""
        tokens = self.job.loss.global_tokens * self.groups.live()
        if own is None:
            return tokens, tokens
        counted = torch.tensor([float(own)], dtype=torch.float64, device=self.job.place.device)
        self.groups.sum_in_buckets_([counted], 1)
        return max(1, int(counted.item())), tokens

    def reduce(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum this step's gradients and loss over the live groups; returns the loss (every group's)."""
        grads = [p.grad for p in self.job.parallel.engine.optimizer_params() if p.grad is not None]
        present = torch.zeros(self.count, dtype=torch.float64, device=loss_sum.device)
        present[self.index] = 1.0
        values = torch.cat([loss_sum.double().flatten(), present])
        self.groups.sum_in_buckets_([*grads, values], self.bucket_elements)
        self.live_ids = [i for i, v in enumerate(values[-self.count :].tolist()) if v > 0.5]
        return values[: -self.count].to(loss_sum.dtype).view_as(loss_sum)

    def sum_(self, t: torch.Tensor) -> None:
        """Sum `t` over the live groups (an MoE's expert loads)."""
        self.groups.sum_in_buckets_([t], t.numel())

    def commit(self, step: int) -> bool:
        """The group's vote on step `step`; after a committed step the launcher learns it."""
        done = self.groups.commit()
        if done:
            self.groups.record_step(step + 1)
        self.retried = not done
        return done

    def replicas_equal(self) -> bool | None:
        """Collective over the live groups: whether every one holds, on every rank, the same bytes of its
        owned rows and optimizer state (None: a group failed while they were compared)."""
        device = self.job.place.device  # (NCCL reduces device tensors only)
        sums = torch.tensor([checksum(t) for t in held_tensors(self.job)], dtype=torch.float64, device=device)
        both = torch.cat([sums, -sums])  # the max of each, and of its negation: equal when max = min
        self.groups.max_(both)
        if self.groups.errored():
            return None
        differs = torch.tensor([float(not torch.equal(both[: len(sums)], -both[len(sums) :]))], device=device)
        self.job.place.comm.all_reduce_(differs, self.job.place.world, op="max")  # on any rank of the group
        return not differs.item()

    def writes(self) -> bool:
        """Whether this group is the lowest live one: the one that logs the metrics and checkpoints."""
        return not self.idle and self.groups.first_live()

    def row(self) -> dict[str, Any]:
        return {"replicas": {"live": len(self.live_ids), "of": self.count, "groups": self.live_ids}}


def held_tensors(job: Any) -> list[torch.Tensor]:
    """What must be equal in every replica group: the owned rows, the optimizer's state tensors and the
    model's buffers (an MoE's balancing bias)."""
    rows = [e.param.detach() for e in job.parallel.engine.owned_rows()]
    states = [v for state in job.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return rows + states + list(job.model.buffers())


def checksum(t: torch.Tensor) -> float:
    """An exact checksum of `t`'s bytes, below 2**40 (exact in float64): each byte weighted by its
    position modulo 251, plus one, summed."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), dtype=torch.int64, device=data.device) % 251 + 1
    return float(int((data * weights).sum()) % (1 << 40))


def join_replica_groups(job: Any, cfg: Config) -> FaultTolerance:
    """This rank's part in the replica groups of `cfg` (the whole job's config), once `job` (its group's,
    from `replica_config`) is set up: the torchft Manager serving and loading `job_state`."""
    index, lighthouse, store = slot_from_env()
    groups = ReplicaGroups(
        index,
        cfg.parallel.dp_replicate,
        lighthouse,
        job.place.world.process_group,
        cfg.run.comm_timeout_s,
        lambda: job_state(job),
        lambda state: load_job_state(job, state),
        store,
    )
    ft = FaultTolerance(job, groups, cfg)
    ft.say(f"replica group {index} of {cfg.parallel.dp_replicate} started (attempt {restart_attempt()})")
    return ft


def slot_from_env() -> tuple[int, str, str]:
    """(this replica group's index, the lighthouse's address, the launcher's store) from the environment
    that commands/replica_launch.py (or the user's own launcher, docs/fault-tolerance.md) sets."""
    if GROUP_ENV not in os.environ or LIGHTHOUSE_ENV not in os.environ:
        raise ConfigError(
            [
                f"fault_tolerance.enabled: each replica group's ranks need {GROUP_ENV} (the group's index) "
                f"and {LIGHTHOUSE_ENV} (the lighthouse's address); `meshtron train --nproc N` sets both, and "
                "under a launcher of your own export them (docs/fault-tolerance.md)"
            ]
        )
    return int(os.environ[GROUP_ENV]), os.environ[LIGHTHOUSE_ENV], os.environ.get(STORE_ENV, "")
