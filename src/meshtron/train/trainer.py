"""The training loop, readable top to bottom: a job set up (setup.py), then `Trainer.step` per step.

A step: for each micro-batch, forward and backward with the loss divided by the *global* token count
(so summing over micro-batches and data-parallel ranks gives the global mean; under pipeline parallel
the runtime runs them in its schedule's order: micro_batches.py) ->
`finish_gradients()` -> exact clipping -> AdamW -> `engine.after_step()`. Its communication is counted
by one `comm.recording()`, so a step's metrics hold its own collectives and nothing else's; its time
by phase (forward, backward, optimizer) and its waits per group by comm/timing.py's clock.

Around the steps (`run_step`): the profiler's window (observe/profiling.py), every log interval's straggler
report (observe/stragglers.py), evaluations, checkpoints (synchronous, or asynchronous: checkpoint/async_save.py).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from meshtron.checkpoint.async_save import AsyncCheckpointer
from meshtron.checkpoint.save_load import SaveRequest, save_checkpoint
from meshtron.comm.mesh import ParallelMesh
from meshtron.comm.replica_groups import restart_attempt
from meshtron.comm.timing import TIMES
from meshtron.config.layout import Dim
from meshtron.config.schema import Config
from meshtron.data.mixture import MixtureSampler
from meshtron.models.layers import DTYPES
from meshtron.observe.expert_load import ExpertLoads
from meshtron.observe.metrics import MetricsLogger, peak_memory_bytes
from meshtron.observe.profiling import StepProfiler, held_bytes, memory_line, predicted_memory, staging_bytes
from meshtron.observe.stragglers import straggler_line, straggler_report
from meshtron.observe.summary import run_summary, summary_text, write_summary
from meshtron.observe.wandb_log import WandbSettings
from meshtron.pictures.experts import draw_expert_load
from meshtron.pictures.loss import plot_loss
from meshtron.pictures.pipeline import draw_measured_timeline
from meshtron.plan.flops import training_flops_per_token
from meshtron.probe.peak import cpu_peak_beaten, job_peak_flops, shown_mfu
from meshtron.rules.data import micro_batches_per_step
from meshtron.train import TrainingDiverged, TrainingInterrupted, sigint_received
from meshtron.train.drills import kill_if_asked, sigkill_if_asked
from meshtron.train.evaluate import Evaluator
from meshtron.train.micro_batches import finish_gradients, run_micro_batches
from meshtron.train.nonfinite import SkipGuard, first_nonfinite_gradient
from meshtron.train.optim import clip_grad_norm_, lr_at
from meshtron.train.sample import checkpoint_files, print_sample
from meshtron.train.setup import checkpoint_root, set_up


class Trainer:
    """One training job on this rank: set up (`job`), then `step()` per optimizer step, or `run()`."""

    def __init__(self, cfg: Config, mesh: ParallelMesh | None = None):
        """`mesh`: reuse the process groups of an earlier job with the same layout in this process."""
        self.job = job = set_up(cfg, mesh)
        place, t = job.place, cfg.training
        self.dp, self.dp_cp = place.mesh.group(Dim.DP), place.mesh.group(place.mesh.with_cp(Dim.DP))
        self.skips = SkipGuard(t.max_skipped_steps)
        # The loads the balancing bias steps on: the global batch's, or under DiLoCo the replica's own.
        loads_over = self.dp_cp if job.outer is None else place.mesh.group(place.mesh.with_cp(Dim.DP_SHARD))
        self.expert_loads = ExpertLoads(
            job.model, place.comm, loads_over, place.mesh.group(Dim.PP), cfg.model.is_moe
        )
        self.peak, self.peak_source = job_peak_flops(place.device, DTYPES[t.dtype], place.comm, place.world)
        self.evaluator = None
        if job.val_data is not None:
            self.evaluator = Evaluator(
                job.parallel, job.val_data, cfg.training, job.loss, place, self.dp, self.dp_cp, job.documents
            )
        self.model_flops = training_flops_per_token(cfg.model, t.seq_len)  # the planner's count
        TIMES.use_device(place.device)
        self.profiler = StepProfiler(
            cfg.profile.steps, Path(cfg.run.dir), place.device, cfg.profile.memory_history
        )
        self.checkpointer = None  # with checkpoint.async: writes in the background (checkpoint/async_save.py)
        if cfg.checkpoint.async_save and cfg.checkpoint.every:
            self.checkpointer = AsyncCheckpointer(place.mesh.checkpoint_group(), cfg.run.comm_timeout_s)
        self.checkpoint_stalls: list[float] = []  # seconds each save held training up
        self.interval_start = job.start_step  # the straggler report's interval: steps after this one
        self.completed = job.start_step  # steps done (and logged), what an interrupt reports
        self.sequence_sums: dict[int, torch.Tensor] | None = None  # a mixture's, of the last step
        self.replicas_equal: bool | None = None  # fault tolerance: the groups' bytes at the end

    # What a test or a benchmark reaches for most, by name.
    cfg = property(lambda self: self.job.cfg)
    comm = property(lambda self: self.job.place.comm)
    model = property(lambda self: self.job.model)
    parallel = property(lambda self: self.job.parallel)
    engine = property(lambda self: self.job.parallel.engine)
    optimizer = property(lambda self: self.job.optimizer)

    def compute_gradients(self) -> torch.Tensor:
        """Forward and backward over this step's micro-batches, gradients synchronised; returns this
        rank's share of the mean cross-entropy (with multi-token prediction followed by each depth's)."""
        job, t = self.job, self.cfg.training
        counted, share = self._divisors()
        # A mixture keeps each sequence's loss, for the loss per source (`_by_source`).
        self.sequence_sums = {} if isinstance(job.sampler, MixtureSampler) else None
        mtp_sums: dict[int, torch.Tensor] | None = {} if self.cfg.model.mtp_depth else None
        batches = job.sampler.next_micro_batches(job.dataset, self.dp.rank, self.dp.size, t.micro_batch)
        loss_sum = run_micro_batches(
            self.parallel,
            batches,
            job.loss.for_step(counted, self.sequence_sums, mtp_sums, share),
            device=job.place.device,
            documents=job.documents,
            before_grads=self.engine.prepare_micro_batch,
        )
        with TIMES.phase("backward", "gradient reductions"):
            finish_gradients(self.parallel)
        if mtp_sums is not None:  # (none on a pipeline's other stages)
            depths = sum(mtp_sums.values(), torch.zeros(self.cfg.model.mtp_depth, device=loss_sum.device))
            loss_sum = torch.cat([loss_sum[None], depths])
        if self.parallel.pipeline is not None:  # the loss is on the last stage only
            return self.comm.all_reduce_(loss_sum, job.place.mesh.group(Dim.PP))
        return loss_sum

    def _divisors(self) -> tuple[int | None, int | None]:
        """(the targets this step's loss divides by, the tokens the MoE auxiliary losses are shared over);
        None: the global batch's. Under DiLoCo each replica's gradient is the mean over its own share of
        the batch (train/diloco.py); under fault tolerance, over the live replica groups' shares
        (train/fault_tolerance.py)."""
        job = self.job
        if job.replicas is not None:
            return job.replicas.loss_divisor(job.sampler.counted_targets(job.dataset, job.sampler.step))
        if job.outer is None:
            return job.sampler.counted_targets(job.dataset, job.sampler.step), None
        replica = job.place.mesh.group(Dim.DP_REPLICATE)
        part = (replica.rank, replica.size)
        counted = job.sampler.counted_targets(job.dataset, job.sampler.step, part)
        share = job.loss.global_tokens // replica.size
        return (share if counted is None else counted), share

    def step(self, step: int) -> dict[str, Any] | None:
        """One optimizer step (0-based `step`); returns its metrics row (None: a replica group's peer
        failed during it, nothing was applied, and the step is to be taken again)."""
        t, comm, replicas = self.cfg.training, self.comm, self.job.replicas
        pp = self.job.place.mesh.group(Dim.PP)
        start = time.perf_counter()
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with comm.recording() as recorded:
            loss_sum = self.compute_gradients()
            comm.all_reduce_(loss_sum, self.dp_cp)  # cp ranks hold parts of the same sequences
            if replicas is not None:  # gradients and loss summed over the live replica groups
                loss_sum = replicas.reduce(loss_sum)
            if self.job.outer is not None:  # DiLoCo: the mean of the replicas' means
                loss_sum /= self.job.outer.replicas.size
            by_source = self._by_source(step) if isinstance(self.job.sampler, MixtureSampler) else {}
            tp_plan, elsewhere = self.parallel.tp_plan, self.parallel.counted_elsewhere
            with TIMES.phase("optimizer", "clip gradients"):
                grad_norm = clip_grad_norm_(self.engine, t.grad_clip, comm, tp_plan, pp, elsewhere)
            if self.job.outer is not None:  # each replica clips its own; skip (non-finite) all or none
                grad_norm = self.job.outer.largest_norm(grad_norm)
            # The step's one read of the device (docs/performance.md), the same on every rank.
            values = torch.cat([loss_sum.double().flatten(), grad_norm.double().flatten()]).tolist()
            loss_value, mtp_values, norm_value = values[0], values[1:-1], values[-1]
            finite = math.isfinite(loss_value) and math.isfinite(norm_value)
            if replicas is not None:  # the loads summed before the vote, then the vote
                loads = self.expert_loads.reduced(replicas.sum_)
                if not replicas.commit(step):
                    self.engine.zero_grad()
                    return None
            first_bad = None
            with TIMES.phase("optimizer"):
                if finite:
                    self.optimizer.step()
                else:  # skipped: nothing changes (nonfinite.py)
                    first_bad = first_nonfinite_gradient(self.engine, comm, self.job.place.world)
                # DiLoCo's outer step, every diloco_every steps (train/diloco.py), on every replica
                outer = self.job.outer is not None and self.job.outer.after_inner_step(step + 1)
                if finite or outer:
                    self.engine.after_step()
            skipped = self.skips.check(step + 1, loss_value, norm_value, first_bad)
            self.engine.zero_grad()
        loads = self.expert_loads.reduced() if replicas is None else loads  # (not the step's traffic)
        extra = self.expert_loads.after_step(loads, finite)  # MoE loads: the bias step and the metrics
        elapsed = time.perf_counter() - start
        TIMES.settle()
        live = len(replicas.live_ids) if replicas is not None else 1  # each group trained its share
        tokens_per_sec = live * self.job.loss.global_tokens / elapsed
        pipeline = self.parallel.pipeline
        if pipeline is not None:  # the mean over stages of the time each spent not computing
            bubble = torch.tensor(pipeline.idle_fraction(), dtype=torch.float64)
            extra["pp_bubble"] = float(comm.all_reduce_(bubble, pp, op="avg"))
        mfu, mfu_note = self._mfu(tokens_per_sec, self.job.place.world_size * live)
        stats = recorded.stats
        return {
            "step": step + 1,
            "loss": loss_value,
            "grad_norm": norm_value,
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,  # None, with the note, when there is no reference or it was measured too low
            **({"mfu_note": mfu_note} if mfu_note else {}),
            "peak_mem_bytes": peak_memory_bytes(self.job.place.device),
            "comm_bytes": stats.total_bytes(),
            "step_time_s": elapsed,
            "comm_bytes_by_group": stats.by_group(),
            "comm_calls_by_group": stats.calls_by_group(),  # collectives issued (each send and receive one)
            # the all-to-alls' bytes sent to another node (run.gpus_per_node), by group
            "comm_network_bytes_by_group": dict(stats.network),
            **extra,
            **skipped,
            **(replicas.row() if replicas is not None else {}),
            **by_source,
            **(
                {"mtp_loss": sum(mtp_values) / len(mtp_values), "mtp_loss_by_depth": mtp_values}
                if mtp_values
                else {}
            ),
        }

    def _mfu(self, tokens_per_sec: float, ranks: int) -> tuple[float | None, str | None]:
        """The step's MFU over `ranks` ranks as shown (probe/peak.py), and its note."""
        raw_mfu = self.model_flops * tokens_per_sec / (self.peak * ranks)
        if raw_mfu > 1.0 and self.job.place.device.type == "cpu":  # the reference was measured too low
            self.peak, self.peak_source = cpu_peak_beaten(DTYPES[self.cfg.training.dtype], self.peak)
            raw_mfu = self.model_flops * tokens_per_sec / (self.peak * ranks)
        return shown_mfu(raw_mfu)

    def _by_source(self, step: int) -> dict[str, Any]:
        """A mixture's tokens and mean cross-entropy per source at `step` (collective over the job)."""
        job, t, comm = self.job, self.cfg.training, self.comm
        sampler, names = job.sampler, job.dataset.names
        sums = sampler.source_sums(self.sequence_sums, step, self.dp.rank, self.dp.size, t.micro_batch)
        comm.all_reduce_(sums, job.place.mesh.group(Dim.PP))  # (the last stage's only)
        comm.all_reduce_(sums, self.dp_cp)
        counted = sampler.counted_by_source(job.dataset, step)
        samples = sampler.samples_by_source(step)
        return {
            "tokens_by_source": {n: k * t.seq_len for n, k in zip(names, samples, strict=True)},
            "loss_by_source": {
                n: float(s / c) for n, s, c in zip(names, sums.tolist(), counted, strict=True) if c
            },
        }

    def close(self) -> None:
        """Release the process groups of this job's mesh if it made them (the world group stays)."""
        if self.job.owns_mesh:
            self.job.place.mesh.close()

    def save(self, step: int) -> float:
        """Checkpoint after `step` steps (collective); returns the seconds training stalled for it."""
        job, start = self.job, time.perf_counter()
        place = job.place
        # What export and generate need besides the state (train/sample.py).
        replicas = job.replicas  # a replica group saves the whole job's config and world
        cfg, world_size = (
            (replicas.cfg, replicas.count * place.world_size) if replicas else (self.cfg, place.world_size)
        )
        files = checkpoint_files(cfg, world_size, job.dataset) if place.rank == 0 else None
        state = {"sampler": job.sampler.state_dict()}
        root, keep = checkpoint_root(self.cfg), self.cfg.checkpoint.keep
        request = SaveRequest(
            root=root,
            step=step,
            engine=self.engine,
            optimizer=self.optimizer,
            train_state=state,
            comm=self.comm,
            world=place.world,
            keep=keep,
            tp_blocks=job.tp_blocks,
            files=files,
            replica=job.outer.replica_state() if job.outer is not None else None,
        )
        if self.checkpointer is not None:
            stall = self.checkpointer.save(request)
        else:
            save_checkpoint(request)
            stall = time.perf_counter() - start
        self.checkpoint_stalls.append(stall)
        return stall

    def draw_pipeline_timeline(self, out_path: Path) -> None:
        """Collective over each pipeline: rank 0 draws its pipeline's last step as measured, next to the
        simulation of the schedule with the measured times."""
        rt, place = self.parallel.pipeline, self.job.place
        ranks = self.comm.all_gather_object((rt.timeline, rt.comm_timeline), place.mesh.group(Dim.PP))
        if place.rank != 0:
            return
        p, t = self.cfg.parallel, self.cfg.training
        microbatches = micro_batches_per_step(t.global_batch, t.micro_batch, self.dp.size)
        timelines, waits = [r[0] for r in ranks], [r[1] for r in ranks]
        path, measured, simulated = draw_measured_timeline(
            timelines, p.pp_schedule, p.vpp, microbatches, out_path, waits, rt.overlap
        )
        print(
            f"meshtron: pipeline timeline of the last step in {path}: bubble {100 * measured:.1f}% measured, "
            f"{100 * simulated:.1f}% simulated with the measured compute times",
            flush=True,
        )

    def run(self) -> list[dict[str, Any]]:
        """All steps from the start (or resume) step; returns the metric rows (on rank 0; [] elsewhere)."""
        cfg, job = self.cfg, self.job
        rank, run_dir, resumed = job.place.rank, Path(cfg.run.dir), job.start_step > 0
        wandb = WandbSettings.of(cfg, job.environment, resume=resumed) if rank == 0 else None
        # Replica groups share one file: only group 0's first attempt may start it or cut it back.
        shared = job.replicas is not None and (job.replicas.index > 0 or restart_attempt() > 0)
        logger = MetricsLogger(
            run_dir,
            enabled=rank == 0,
            append=resumed or shared,
            last_step=None if shared else job.start_step,
            wandb=wandb,
        )
        if rank == 0:
            print(
                f"meshtron: {job.n_params:,} parameters, world {job.place.world_size} ({job.place.device.type}), "
                f"{job.dims.summary()}; MFU relative to {self.peak_source}",
                flush=True,
            )
        TIMES.take()  # the straggler report's first interval starts here (not at an earlier job's steps)
        step = job.start_step
        while step < cfg.training.steps:
            if job.replicas is not None:  # the quorum; a restarted group heals and jumps ahead
                step = job.replicas.begin(step)
                if step >= cfg.training.steps:
                    break
            step += self.run_step(step, logger)
        self.engine.finish_params()  # e.g. ZeRO-1/2's last gathers: the model is whole when the run ends
        if job.replicas is not None and not job.replicas.idle:  # the live groups' bytes compared
            self.replicas_equal = job.replicas.replicas_equal()
        if self.checkpointer is not None:
            self.checkpointer.wait()  # the last save is published before the run ends
        self.finish(logger)
        logger.close()
        return logger.rows

    def _group_writes(self) -> bool:
        """Whether this rank's replica group is the one that writes (every group, without replicas)."""
        return self.job.replicas is None or self.job.replicas.writes()

    def leads(self) -> bool:
        """Whether this rank speaks for the job: rank 0 (of the lowest live replica group)."""
        replicas = self.job.replicas
        return self.job.place.rank == 0 and (replicas is None or replicas.writes())

    def run_step(self, step: int, logger: MetricsLogger) -> bool:
        """Step `step` and what follows it: its metrics row and console line, the evaluation and the
        checkpoint when due, the fault injection of restart drills. Returns whether the step was taken
        (not: a replica group's peer failed during it)."""
        cfg, last, replicas = self.cfg, self.cfg.training.steps - 1, self.job.replicas
        comm, world, profiler = self.comm, self.job.place.world, self.profiler
        rank = self.job.place.rank if replicas is None else replicas.global_rank(self.job.place.rank)
        sigkill_if_asked(rank, step + 1)
        if profiler.recording(step + 1):
            profiler.before(step + 1, comm, world, lambda: held_bytes(self.model, self.optimizer))
            with TIMES.span(f"step {step + 1}"):
                row = self.step(step)
            predicted = lambda: predicted_memory(cfg, self.job.place)  # noqa: E731
            profiler.after(step + 1, comm, world, predicted, staging_bytes(self.engine))
        else:
            row = self.step(step)
        if row is None:
            return False
        due = step % cfg.run.log_every == 0 or step == last
        straggler = self.straggler_fields(step) if due and world.size > 1 else {}
        row.update(straggler)
        leads = self.leads()
        if leads:
            logger.log(row)
        self.completed = step + 1  # before its evaluation and checkpoint: an interrupt there is after it
        if leads and (due or row.get("skipped")):
            print(MetricsLogger.console_line(row), flush=True)
            line = straggler and straggler_line(straggler, cfg.profile.straggler_threshold)
            if line:
                print(line, flush=True)
        if self.evaluator is not None and self.evaluator.due(step + 1):
            with self.comm.recording():  # not the next step's communication
                val = self.evaluator.evaluate(step + 1)
            if leads:
                logger.log(val)
                print(MetricsLogger.val_line(val), flush=True)
        due = cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step == last)
        if due and self._group_writes():  # one replica group's copy
            stall = self.save(step + 1)
            if leads:
                how = "staged; writing it in the background" if self.checkpointer else "written"
                print(
                    f"meshtron: checkpoint step-{step + 1:08d} {how}: training stalled {stall:.2f} s",
                    flush=True,
                )
        kill_if_asked(rank, step + 1)
        return True

    def straggler_fields(self, step: int) -> dict[str, Any]:
        """Collective over the job: the straggler report of the steps since the last one (observe/stragglers.py)."""
        times = self.comm.all_gather_object(TIMES.take(), self.job.place.world)
        first, self.interval_start = self.interval_start + 1, step + 1
        return {"straggler_steps": [first, step + 1], **straggler_report(times, step + 1 - first + 1)}

    def finish(self, logger: MetricsLogger) -> None:
        """After the last step: the pictures, a sample of text, the run summary."""
        cfg, job = self.cfg, self.job
        run_dir, ran, lead = Path(cfg.run.dir), cfg.training.steps > job.start_step, self.leads()
        if lead and cfg.run.plot and logger.rows:
            title = f"{cfg.model.name or run_dir.name}: {job.n_params:,} parameters, {job.dims.summary()}"
            rows, eval_rows = logger.history()  # a resumed run's earlier steps too
            plot_loss(rows, run_dir / "loss.png", title, eval_rows)
            draw_expert_load(rows, run_dir / "expert-load.png", f"expert load per MoE layer: {title}")
        if cfg.run.plot and self.parallel.pipeline is not None and ran and self._group_writes():
            self.draw_pipeline_timeline(run_dir / "pipeline-timeline.png")
        if lead and cfg.run.sample_tokens and ran:
            data = job.val_data if job.val_data is not None else job.dataset
            print_sample(cfg, job.place.world_size, self.model, checkpoint_root(cfg), data)
        if lead:
            wall = time.perf_counter() - job.started
            rows, eval_rows = logger.history() if logger.shared else (logger.rows, logger.eval_rows)
            summary = run_summary(
                rows,
                eval_rows,
                wall,
                self.model_flops,
                self.peak,
                self.peak_source,
                job.place.world_size,
            )
            summary.update(self.operations_summary())
            write_summary(summary, run_dir)
            print(summary_text(summary), flush=True)
            if self.profiler.peaks_by_rank:
                print(memory_line(self.profiler.peaks_by_rank), flush=True)

    def operations_summary(self) -> dict[str, Any]:
        """The run summary's keys from the profiled steps' memory and the checkpoints' stalls."""
        out: dict[str, Any] = {}
        if self.profiler.peaks_by_rank:  # each rank's peak bytes per phase and the planner's parts
            out["memory_by_phase"] = self.profiler.peaks_by_rank
        if self.replicas_equal is not None or self.job.replicas is not None:
            out["replicas_equal"] = self.replicas_equal  # (train/fault_tolerance.py; None: not compared)
        if self.checkpoint_stalls:
            stalls = self.checkpoint_stalls
            out["checkpoint_stall_s"] = {
                "mode": "async" if self.checkpointer else "sync",
                "saves": len(stalls),
                "median": statistics.median(stalls),
                "max": max(stalls),
            }
        return out


def by_ctrl_c(err: BaseException) -> bool:
    """Whether `err` is Ctrl-C's KeyboardInterrupt or carries one: chained (raised while handling it), or
    among the ranks' failures a checkpoint save wraps (torch.distributed.checkpoint catches them all)."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        pending += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            pending += [failure for failure, _ in e.failures.values()]
    return False


def train(cfg: Config, mesh: ParallelMesh | None = None) -> list[dict[str, Any]]:
    """Run cfg.training.steps optimizer steps; returns the metric rows (on rank 0; [] elsewhere)."""
    owns_world = not dist.is_initialized()  # this call starts the process group, so it ends it
    trainer = Trainer(cfg, mesh)
    finished = False
    try:
        rows = trainer.run()
        finished = True
        return rows
    except TrainingDiverged:  # every rank stops here alike: the save in flight (finite) is published first
        if trainer.checkpointer is not None:
            trainer.checkpointer.wait()
        raise
    except BaseException as stop:
        if by_ctrl_c(stop) or sigint_received():  # what was complete, for the line (commands/interrupt.py)
            raise TrainingInterrupted(trainer.completed) from stop
        raise
    finally:
        if owns_world and finished:  # no rank closes a connection a peer still uses
            trainer.comm.barrier(trainer.job.place.world)
        trainer.close()
        if owns_world and dist.is_initialized():
            # Release the backend's threads and sockets before the interpreter exits: left to exit-time
            # destructors, a group can abort the process after a finished run.
            dist.destroy_process_group()
