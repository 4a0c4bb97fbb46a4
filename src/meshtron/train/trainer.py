"""The training loop: build the model -> parallelize -> optimizer -> steps, readable top to bottom.

A step (`Trainer.step`): for each micro-batch, forward and backward with the loss divided by the
*global* token count (so summing over micro-batches and data-parallel ranks gives the global mean) ->
`engine.finish_gradients()` -> exact clipping -> AdamW -> `engine.after_step()`. Under pipeline
parallel, the pipeline runtime runs the micro-batches in its schedule's order instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtron.comm import Comm, CommGroup
from meshtron.comm_record import recorder
from meshtron.config import Config, ConfigError, DType, check
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, default_dataset
from meshtron.data.sampler import BatchSampler, micro_batches_per_step
from meshtron.data.validation import split_validation
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import build_model
from meshtron.models.loss import MicroBatchLoss
from meshtron.parallel.data_parallel import DTYPES
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.parallelize import parallelize
from meshtron.pipeline.picture import draw_measured_timeline
from meshtron.records import write_run_records
from meshtron.train.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from meshtron.train.checkpoint_blocks import ShardBlocks
from meshtron.train.checkpoint_integrity import corrupt_files, unwritable
from meshtron.train.evaluate import Evaluator
from meshtron.train.expert_load import ExpertLoads, draw_expert_load
from meshtron.train.init_from_hf import LoadReport, load_hf_weights
from meshtron.train.metrics import MetricsLogger, flops_per_token, peak_memory_bytes, plot_loss
from meshtron.train.nonfinite import SkipGuard, first_nonfinite_gradient
from meshtron.train.optim import build_optimizer, clip_grad_norm_, lr_at
from meshtron.train.peak import job_peak_flops, shown_mfu
from meshtron.train.sample import checkpoint_files, print_sample
from meshtron.train.summary import run_summary, summary_text, write_summary
from meshtron.train.wandb_log import WandbSettings


@dataclass
class RankPlace:
    """Where this process sits in the job: its rank, device, mesh and communication layer."""

    rank: int
    world_size: int
    device: torch.device
    mesh: ParallelMesh
    comm: Comm
    world: CommGroup


def _job_store(timeout: datetime.timedelta) -> dist.Store:
    """The store torchrun (or env://) gives the job. Under torchrun's shared agent store, keys are prefixed
    by the restart attempt: the store outlives restarts, and without the prefix a restarted rank could
    read the address a dead rank published in the previous attempt. The attempt number is each node's
    own, so multi-node restarts need a fresh store per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    docs/launching.md): refused otherwise, before any rank connects."""
    addr, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # what env:// builds
        return dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ConfigError(
            [
                f"restarts of a {nodes}-node job over torchrun's shared store cannot agree on the attempt; "
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (examples/slurm.sh does)"
            ]
        )
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshtron/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """Join the job torchrun (or our own launcher) started, or make a one-rank job: the same code path
    then runs on one device and on many, with every group of size 1 costing nothing."""
    want_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["run.device='cuda' but no CUDA device is visible; use run.device='cpu'"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if want_cuda else "gloo"
        timeout = datetime.timedelta(seconds=cfg.run.comm_timeout_s)
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            store, rank = _job_store(timeout), int(os.environ["RANK"])
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
            )
            recorder().attach(store, rank)  # what each rank was doing, should a collective hang
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def say(rank: int, text: str) -> None:
    """One line on rank 0's console: what a long start-up phase is doing."""
    if rank == 0:
        print(f"meshtron: {text}", flush=True)


def open_dataset(cfg: Config, place: RankPlace) -> PreparedData:
    """The training data; rank 0 prepares the default corpus on first use while the others wait."""
    if cfg.data.path != "default":
        dataset = PreparedData.open(cfg.data.path)
    else:
        if place.rank == 0:
            dataset = default_dataset(
                tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab, say=partial(say, 0)
            )
        place.comm.barrier(place.world)
        if place.rank != 0:
            dataset = default_dataset(tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab)
    if dataset.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the dataset's vocabulary has {dataset.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}; set --model.vocab_size={dataset.vocab_size} or larger"
        )
    return dataset


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"


def autocast_context(device: torch.device, dtype: DType) -> contextlib.AbstractContextManager:
    """bf16 autocast over fp32 master weights, or nothing for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


class Trainer:
    """One training job on this rank: everything built up front, then `step()` per optimizer step."""

    def __init__(self, cfg: Config, mesh: ParallelMesh | None = None):
        """`mesh`: reuse the process groups of an earlier job with the same layout in this process."""
        self.started = time.perf_counter()  # the summary's wall time counts set-up and data preparation
        rank, world_size, device = init_distributed(cfg)
        # First, so that any report of a problem says which torch and backend ran it.
        say(
            rank,
            f"torch {torch.__version__}, {dist.get_backend()} backend, {world_size} rank(s) on {device.type}",
        )
        check(cfg, world_size)
        for directory in [Path(cfg.run.dir)] + ([checkpoint_root(cfg)] if cfg.checkpoint.every else []):
            why = unwritable(directory, rank)
            if why:  # found before any work, not at the first checkpoint
                raise CheckpointError(
                    f"{why}; set run.dir (or checkpoint.dir) to a directory this job can write"
                )
        self.dims = ParallelDims.from_config(cfg.parallel, world_size)
        if mesh is not None and mesh.dims != self.dims:
            raise ValueError(
                f"the given mesh is {mesh.dims.summary()}, the config asks for {self.dims.summary()}"
            )
        self.owns_mesh = mesh is None
        comm = Comm(cfg.run.comm_timeout_s)
        world = comm.group("world", list(range(world_size)), dist.group.WORLD)
        mesh = mesh or ParallelMesh(self.dims, device.type)
        self.place = RankPlace(rank, world_size, device, mesh, comm, world)
        self.cfg, self.comm, self.device = cfg, comm, device
        # Before the long phases, so that a run dying in start-up still says what it was (records.py).
        self.environment = write_run_records(cfg.run.dir, cfg, world_size) if rank == 0 else None
        t = cfg.training
        torch.manual_seed(t.seed)

        # With data.val_fraction, training samples only the tokens before the held-out tail.
        self.dataset, self.val_data = split_validation(cfg, open_dataset(cfg, self.place))
        self.sampler = BatchSampler(self.dataset.n_tokens, t.seq_len, t.global_batch, t.seed)
        m = cfg.model
        model_says = f"{m.name or 'custom'}: {m.n_layers} layers, dim {m.dim}, on {device.type}"
        say(rank, f"building the model ({model_says}) and parallelizing it: {self.dims.summary()}")
        self.model = build_model(cfg.model, seed=t.seed, device=device)
        self.n_params = self.model.num_params()
        self.parallel = parallelize(self.model, comm, mesh, cfg)
        self.engine, self.tp_plan, self.pipeline = (
            self.parallel.engine,
            self.parallel.tp_plan,
            self.parallel.pipeline,
        )
        self.optimizer = build_optimizer(
            self.engine.optimizer_params(), t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay
        )
        autocast = partial(autocast_context, device, t.dtype)
        self.loss = MicroBatchLoss(self.parallel.token_loss, t.global_batch * t.seq_len, autocast)
        self.tp_blocks = None  # where tensor- and expert-parallel shards sit, for checkpoints
        experts = expert_parameter_names(self.model) if self.dims.ep > 1 else frozenset()
        if self.tp_plan is not None or experts:
            self.tp_blocks = ShardBlocks(self.tp_plan, mesh.grid("dp_shard_cp", "tp"), self.dims.ep, experts)
        self.start_step = self.resume_if_asked()
        self.init_report: LoadReport | None = None  # what this rank read of model.init_from
        if cfg.model.init_from and self.resumed_from is None:  # a resumed run keeps its own weights
            self.init_report = self.init_from_hf()
        self.dp, self.dp_cp = mesh.group("dp"), mesh.group(mesh.with_cp("dp"))
        self.skips = SkipGuard(t.max_skipped_steps)
        self.expert_loads = ExpertLoads(self.model, comm, self.dp_cp, mesh.group("pp"), cfg.model.is_moe)
        self.peak, self.peak_source = job_peak_flops(device, DTYPES[t.dtype], comm, world)
        self.evaluator = Evaluator(self, self.val_data) if self.val_data is not None else None
        self.model_flops = flops_per_token(cfg.model, t.seq_len)

    def resume_if_asked(self) -> int:
        """The step to start from: the newest intact checkpoint's with checkpoint.resume or after the
        launcher restarted the ranks (a rank died), else 0. Starting afresh over existing checkpoints is
        refused so that they are never overwritten by accident."""
        self.resumed_from: Path | None = None  # the checkpoint loaded, which takes precedence over init_from
        root = checkpoint_root(self.cfg)
        existing = complete_checkpoints(root)
        restarted = False
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a node whose ranks did not fail keeps its count
            restarts = torch.tensor([int(os.environ["TORCHELASTIC_RESTART_COUNT"])])
            restarted = int(self.comm.all_reduce_(restarts, self.place.world, op="max")) > 0
        if not (self.cfg.checkpoint.resume or restarted):
            if existing:
                raise CheckpointError(
                    f"{root} already holds checkpoints (newest: step {existing[-1].step}); set "
                    "--checkpoint.resume=true to continue from it, or use another run.dir / checkpoint.dir"
                )
            return 0
        if not existing:
            return 0
        newest = self.intact_checkpoint(existing)
        say(self.place.rank, f"loading checkpoint {newest.path}")
        state = {"sampler": self.sampler.state_dict()}
        train_state = load_checkpoint(newest.path, self.engine, self.optimizer, state, self.tp_blocks)
        self.sampler.load_state_dict(train_state["sampler"])  # its next step is the step to resume at
        self.resumed_from = newest.path
        if self.place.rank == 0:
            print(f"meshtron: resumed from {newest.path} at step {self.sampler.step}", flush=True)
        return self.sampler.step

    def init_from_hf(self) -> LoadReport:
        """model.init_from's weights into this layout, each rank reading only its slices (init_from_hf.py)."""
        path, rank = self.cfg.model.init_from, self.place.rank
        say(rank, f"loading the Hugging Face checkpoint {path}")
        ep = self.place.mesh.group("ep")
        report = load_hf_weights(path, self.parallel, self.cfg.model, ep, self.place.world)
        say(rank, f"initialised from {path} ({report.elements:,} values read by rank 0)")
        return report

    def intact_checkpoint(self, existing: list[CheckpointInfo]) -> CheckpointInfo:
        """The newest of `existing` whose files match their manifest; each corrupt one skipped with a
        warning that names its files."""
        for info in reversed(existing):
            problems = corrupt_files(info.path, self.comm, self.place.world)
            if not problems:
                return info
            if self.place.rank == 0:
                print(
                    f"meshtron: warning: checkpoint {info.path} is corrupt ({'; '.join(problems)}); "
                    "falling back to the previous complete checkpoint",
                    flush=True,
                )
        raise CheckpointError(
            f"every checkpoint in {existing[-1].path.parent} is corrupt; start a new run.dir, or restore one"
        )

    def compute_gradients(self) -> torch.Tensor:
        """Forward and backward over this step's micro-batches, gradients synchronised; returns this
        rank's share of the mean cross-entropy."""
        t = self.cfg.training
        batches = self.sampler.next_micro_batches(self.dataset, self.dp.rank, self.dp.size, t.micro_batch)
        local = self.parallel.local_sequence  # under cp: this rank's tokens of each sequence
        batches = [
            (local(inputs).to(self.device), local(targets).to(self.device)) for inputs, targets in batches
        ]
        positions = self.parallel.positions_of(batches[0][0])
        if self.pipeline is not None:  # the schedule's order; the loss is on the last stage only
            loss_sum = self.pipeline.run(
                batches, self.loss, before_grads=self.engine.prepare_micro_batch, positions_BS=positions
            )
            self.parallel.finish_gradients()
            return self.comm.all_reduce_(loss_sum, self.place.mesh.group("pp"))
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(batches):
            self.engine.prepare_micro_batch(is_last=index == len(batches) - 1)
            with self.loss.autocast():
                logits, aux = self.model(inputs, positions, return_aux=True)
            loss, ce = self.loss.of(logits, aux, targets)
            loss.backward()
            loss_sum += ce.detach()
        self.parallel.finish_gradients()
        return loss_sum

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step (0-based `step`); returns its metrics row."""
        t, pp = self.cfg.training, self.place.mesh.group("pp")
        start = time.perf_counter()
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = self.compute_gradients()
        self.comm.all_reduce_(loss_sum, self.dp_cp)  # cp ranks hold parts of the same sequences
        grad_norm = clip_grad_norm_(
            self.engine, t.grad_clip, self.comm, self.tp_plan, pp, self.parallel.counted_elsewhere()
        )
        finite = bool(torch.isfinite(loss_sum) and torch.isfinite(grad_norm))  # the same on every rank
        first_bad = None
        if finite:
            self.optimizer.step()
            self.engine.after_step()
        else:  # skipped: nothing changes (nonfinite.py)
            first_bad = first_nonfinite_gradient(self.engine, self.comm, self.place.world)
        skipped = self.skips.check(step + 1, float(loss_sum), float(grad_norm), first_bad)
        self.engine.zero_grad()

        stats = self.comm.stats
        comm_bytes, comm_by_group, calls_by_group = (
            stats.total_bytes(),
            stats.by_group(),
            stats.calls_by_group(),
        )
        extra = self.expert_loads.after_step(finite)  # MoE loads: the balancing bias step and the metrics
        self.comm.stats.reset()
        elapsed = time.perf_counter() - start
        tokens_per_sec = self.loss.global_tokens / elapsed
        if self.pipeline is not None:  # the mean over stages of the time each spent not computing
            bubble = torch.tensor(self.pipeline.idle_fraction(), dtype=torch.float64)
            extra["pp_bubble"] = float(self.comm.all_reduce_(bubble, pp, op="avg"))
            self.comm.stats.reset()
        mfu, mfu_note = shown_mfu(self.model_flops * tokens_per_sec / (self.peak * self.place.world_size))
        return {
            "step": step + 1,
            "loss": float(loss_sum),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,  # None, with the note, when there is no reference or it was measured too low
            **({"mfu_note": mfu_note} if mfu_note else {}),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes": comm_bytes,
            "step_time_s": elapsed,
            "comm_bytes_by_group": comm_by_group,
            "comm_calls_by_group": calls_by_group,  # collectives issued (each send and receive one)
            **extra,
            **skipped,
        }

    def close(self) -> None:
        """Release the process groups of this job's mesh if it made them (the world group stays)."""
        if self.owns_mesh:
            self.place.mesh.close()

    def save(self, step: int) -> None:
        save_checkpoint(
            checkpoint_root(self.cfg),
            step,
            self.engine,
            self.optimizer,
            {"sampler": self.sampler.state_dict()},
            self.comm,
            self.place.world,
            self.cfg.checkpoint.keep,
            self.tp_blocks,
            # What export and generate need besides the state (train/sample.py).
            checkpoint_files(self.cfg, self.place.world_size, self.dataset) if self.place.rank == 0 else None,
        )

    def draw_pipeline_timeline(self, out_path: Path) -> None:
        """Collective over each pipeline: rank 0 draws its pipeline's last step as measured, next to the
        simulation of the schedule with the measured times."""
        rt = self.pipeline
        ranks = self.comm.all_gather_object((rt.timeline, rt.comm_timeline), self.place.mesh.group("pp"))
        if self.place.rank != 0:
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
        cfg, rank = self.cfg, self.place.rank
        run_dir = Path(cfg.run.dir)
        resumed = self.start_step > 0
        wandb = WandbSettings.of(cfg, self.environment, resume=resumed) if rank == 0 else None
        logger = MetricsLogger(
            run_dir, enabled=rank == 0, append=resumed, last_step=self.start_step, wandb=wandb
        )
        if rank == 0:
            print(
                f"meshtron: {self.n_params:,} parameters, world {self.place.world_size} ({self.device.type}), "
                f"{self.dims.summary()}; MFU relative to {self.peak_source}",
                flush=True,
            )
        last = cfg.training.steps - 1
        for step in range(self.start_step, cfg.training.steps):
            row = self.step(step)
            logger.log(row)
            if rank == 0 and (step % cfg.run.log_every == 0 or step == last or row.get("skipped")):
                print(MetricsLogger.console_line(row), flush=True)
            if self.evaluator is not None and self.evaluator.due(step + 1):
                val = self.evaluator.evaluate(step + 1)
                logger.log(val)
                if rank == 0:
                    print(MetricsLogger.val_line(val), flush=True)
            if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step == last):
                self.save(step + 1)
            kill_if_asked(rank, step + 1)
        self.engine.finish_params()  # e.g. ZeRO-1/2's last gathers: the model is whole when the run ends
        if rank == 0 and cfg.run.plot and logger.rows:
            title = f"{cfg.model.name or run_dir.name}: {self.n_params:,} parameters, {self.dims.summary()}"
            plot_loss(logger.rows, run_dir / "loss.png", title, logger.eval_rows)
            draw_expert_load(logger.rows, run_dir / "expert-load.png", f"expert load per MoE layer: {title}")
        if cfg.run.plot and self.pipeline is not None and cfg.training.steps > self.start_step:
            self.draw_pipeline_timeline(run_dir / "pipeline-timeline.png")
        if rank == 0 and cfg.run.sample_tokens and cfg.training.steps > self.start_step:
            data = self.val_data if self.val_data is not None else self.dataset
            print_sample(cfg, self.place.world_size, self.model, checkpoint_root(cfg), data)
        self.summarize(logger)
        logger.close()
        return logger.rows

    def summarize(self, logger: MetricsLogger) -> None:
        """Rank 0: the run summary on the console and in run.dir/summary.json (summary.py)."""
        if self.place.rank != 0:
            return
        wall = time.perf_counter() - self.started
        world = self.place.world_size
        summary = run_summary(
            logger.rows, logger.eval_rows, wall, self.model_flops, self.peak, self.peak_source, world
        )
        write_summary(summary, Path(self.cfg.run.dir))
        print(summary_text(summary), flush=True)


def kill_if_asked(rank: int, step: int) -> None:
    """Fault injection for restart tests and drills: MESHTRON_KILL_AT="RANK:STEP" ends rank RANK's process
    abruptly after step STEP (and its checkpoint, if one is due), on the first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ.get("MESHTRON_KILL_AT") == f"{rank}:{step}":
        os._exit(17)


def train(cfg: Config, mesh: ParallelMesh | None = None) -> list[dict[str, Any]]:
    """Run cfg.training.steps optimizer steps; returns the metric rows (on rank 0; [] elsewhere)."""
    owns_world = not dist.is_initialized()  # this call starts the process group, so it ends it
    trainer = Trainer(cfg, mesh)
    finished = False
    try:
        rows = trainer.run()
        finished = True
        return rows
    finally:
        if owns_world and finished:  # no rank closes a connection a peer still uses
            trainer.comm.barrier(trainer.place.world)
        trainer.close()
        if owns_world and dist.is_initialized():
            # Release the backend's threads and sockets before the interpreter exits: left to exit-time
            # destructors, a group can abort the process after a finished run.
            dist.destroy_process_group()
