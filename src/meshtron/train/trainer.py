"""The training loop: build the model -> parallelize -> optimizer -> steps, readable top to bottom."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.comm import Comm, CommGroup
from meshtron.config import Config, ConfigError, TrainingConfig, check
from meshtron.mesh import PP_ENDS, ParallelDims, ParallelMesh
from meshtron.models.llama import Transformer, build_model
from meshtron.parallel.data import DataParallelEngine, DistributedDataParallel
from meshtron.parallel.fsdp import FullyShardedDataParallel, TorchFSDP
from meshtron.parallel.optim import ZeroShardedOptimizer, build_optimizer, clip_grad_norm_
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel, vocab_parallel_cross_entropy
from meshtron.pipeline.picture import draw_measured_timeline
from meshtron.pipeline.runtime import TIED_WEIGHT, PipelineRuntime, keep_rank_chunks, sum_tied_gradients
from meshtron.pipeline.split import chunks_of_rank, split_layers
from meshtron.train.checkpoint import (
    CheckpointError,
    TensorParallelBlocks,
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from meshtron.train.data import BatchSampler, DataError, PreparedData, default_dataset
from meshtron.train.metrics import MetricsLogger, flops_per_token, peak_flops, peak_memory_bytes, plot_loss


@dataclass
class Runtime:
    """Where this process sits: its rank, device, mesh and communication layer."""

    rank: int
    world_size: int
    device: torch.device
    mesh: ParallelMesh
    comm: Comm
    world: CommGroup


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
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


DTYPES = types.MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16})


def ensure_implemented(cfg: Config, dims: ParallelDims) -> None:
    """Layouts the config accepts but this version cannot run yet are refused before any work starts."""
    missing = {"cp": "context parallel", "ep": "expert parallel"}
    problems = [
        f"parallel.{dim}={dims.size(dim)}: {what} is not implemented yet; use parallel.{dim}=1"
        for dim, what in missing.items()
        if dims.size(dim) > 1
    ]
    if dims.pp > 1 and dims.dp_shard > 1 and cfg.parallel.zero == 3 and cfg.parallel.fsdp_impl == "torch":
        problems.append(
            "PyTorch's fully_shard is not wired into the pipeline runtime; use parallel.fsdp_impl='meshtron' "
            "with parallel.pp > 1"
        )
    torch_fsdp = dims.dp_shard > 1 and cfg.parallel.zero == 3 and cfg.parallel.fsdp_impl == "torch"
    if dims.tp > 1 and torch_fsdp and (cfg.checkpoint.every or cfg.checkpoint.resume):
        problems.append(
            "checkpoints of PyTorch's fully_shard over tensor-parallel shards are not implemented; use "
            "parallel.fsdp_impl='meshtron', or checkpoint.every=0 and checkpoint.resume=false"
        )
    if problems:
        raise ConfigError(problems)


def open_dataset(cfg: Config, rt: Runtime) -> PreparedData:
    """Rank 0 prepares the default corpus on first use while the others wait, then everyone opens it."""
    if cfg.data.path != "default":
        return PreparedData.open(cfg.data.path)
    if rt.rank == 0:
        dataset = default_dataset(tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab)
    rt.comm.barrier(rt.world)
    if rt.rank != 0:
        dataset = default_dataset(tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab)
    return dataset


def lr_at(step: int, t: TrainingConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"


def resume_if_asked(
    cfg: Config,
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
    tp_blocks: TensorParallelBlocks | None,
) -> int:
    """The step to start from: the newest complete checkpoint's with checkpoint.resume, else 0. Starting
    afresh over existing checkpoints is refused so that they are never overwritten by accident."""
    existing = complete_checkpoints(checkpoint_root(cfg))
    if not cfg.checkpoint.resume:
        if existing:
            raise CheckpointError(
                f"{checkpoint_root(cfg)} already holds checkpoints (newest: step "
                f"{existing[-1].step}); set --checkpoint.resume=true to continue from it, "
                "or use another run.dir / checkpoint.dir"
            )
        return 0
    if not existing:
        return 0
    train_state = load_checkpoint(
        existing[-1].path, engine, optimizer, {"sampler": sampler.state_dict()}, tp_blocks
    )
    sampler.load_state_dict(train_state["sampler"])  # the sampler's next step is the step to resume at
    if dist.get_rank() == 0:
        print(f"meshtron: resumed from {existing[-1].path} at step {sampler.step}", flush=True)
    return sampler.step


def parallelize(
    model: Transformer, rt: Runtime, cfg: Config
) -> tuple[DataParallelEngine, TensorParallelPlan | None, PipelineRuntime | None]:
    """Apply the parallelisms in a fixed, visible order: pipeline (keep this stage's chunks), tensor
    (+ sequence) parallel, activation recompute, then data parallel, which returns the engine the loop
    drives. dp_shard > 1 shards with ZeRO-`zero` (hybrid with dp_replicate > 1); otherwise the replicas
    are DDP (a group of size 1 costs nothing)."""
    p, t = cfg.parallel, cfg.training
    comm, mesh = rt.comm, rt.mesh
    pp, tp = mesh.group("pp"), mesh.group("tp")
    if pp.size > 1:
        layer_split = split_layers(
            cfg.model.n_layers,
            pp.size * p.vpp,
            p.pp_embedding_layers,
            p.pp_head_layers,
            p.pp_layers or None,
        )
        keep_rank_chunks(model, chunks_of_rank(pp.rank, pp.size, p.vpp), layer_split)
    plan = apply_tensor_parallel(model, comm, tp, p.sp) if tp.size > 1 else None
    apply_recompute(model, t.recompute)
    pipeline = None
    if pp.size > 1:
        seq_shards = tp.size if p.sp else 1
        pipeline = PipelineRuntime(model, comm, pp, p.vpp, p.pp_schedule, layer_split, seq_shards)

    shard, replicate = mesh.group("dp_shard"), mesh.group("dp_replicate")
    reduce_dtype = DTYPES[p.reduce_dtype]
    bucket_bytes = int(p.bucket_mb * 2**20)
    if shard.size == 1:
        engine = DistributedDataParallel(model, comm, mesh.group("dp"), bucket_bytes, reduce_dtype)
        return engine, plan, pipeline
    if p.zero in (1, 2):
        engine = ZeroShardedOptimizer(
            model, comm, shard, replicate, p.zero, bucket_bytes, reduce_dtype, mesh.mesh("dp_shard")
        )
        return engine, plan, pipeline
    blocks = list(model.layers.values())
    param_dtype = DTYPES[t.dtype]
    if p.fsdp_impl == "torch":
        device_mesh = mesh.world["dp_replicate", "dp_shard"] if replicate.size > 1 else mesh.mesh("dp_shard")
        engine = TorchFSDP(
            model, blocks, device_mesh, shard, param_dtype, reduce_dtype, p.reshard_after_forward
        )
        return engine, plan, pipeline
    engine = FullyShardedDataParallel(
        model,
        blocks,
        comm,
        shard,
        replicate,
        param_dtype,
        reduce_dtype,
        p.reshard_after_forward,
        mesh.mesh("dp_shard"),
        root=pipeline.boundary_chunk() if pipeline is not None else None,
    )
    return engine, plan, pipeline


def autocast_context(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast over fp32 master weights, or nothing for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def micro_batch_loss(
    model: Transformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    global_tokens: int,
    dtype: str,
    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, its cross-entropy part), both already divided by the global token count so
    that summing over micro-batches and data-parallel ranks gives the mean over the global batch."""
    autocast = (
        torch.autocast(inputs.device.type, dtype=torch.bfloat16)
        if dtype == "bf16"
        else contextlib.nullcontext()
    )
    with autocast:
        logits, aux_loss = model(inputs, return_aux=True)
    ce = token_loss(logits, targets).sum() / global_tokens
    # The aux loss is a per-micro-batch mean; weight it by this micro-batch's share of the tokens.
    return ce + aux_loss.float() * (targets.numel() / global_tokens), ce


def cross_entropy_per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none")


class Trainer:
    """One training job on this rank: everything built up front, then `step()` per optimizer step."""

    def __init__(self, cfg: Config, mesh: ParallelMesh | None = None):
        """`mesh`: reuse the process groups of an earlier job with the same layout in this process."""
        rank, world_size, device = init_distributed(cfg)
        check(cfg, world_size)
        self.dims = ParallelDims.from_config(cfg.parallel, world_size)
        ensure_implemented(cfg, self.dims)
        if mesh is not None and mesh.dims != self.dims:
            raise ValueError(
                f"the given mesh is {mesh.dims.summary()}, the config asks for {self.dims.summary()}"
            )
        self.owns_mesh = mesh is None
        comm = Comm(cfg.run.comm_timeout_s)
        world = comm.group("world", list(range(world_size)), dist.group.WORLD)
        mesh = mesh or ParallelMesh(self.dims, device.type)
        self.rt = Runtime(rank, world_size, device, mesh, comm, world)
        self.cfg, self.comm, self.device = cfg, comm, device
        t = cfg.training
        torch.manual_seed(t.seed)

        self.dataset = open_dataset(cfg, self.rt)
        if self.dataset.vocab_size > cfg.model.vocab_size:
            raise DataError(
                f"the dataset's vocabulary has {self.dataset.vocab_size} tokens but "
                f"model.vocab_size={cfg.model.vocab_size}; set --model.vocab_size="
                f"{self.dataset.vocab_size} or larger"
            )
        self.sampler = BatchSampler(self.dataset.n_tokens, t.seq_len, t.global_batch, t.seed)

        self.model = build_model(cfg.model, seed=t.seed, device=device)
        self.n_params = self.model.num_params()
        self.engine, self.tp_plan, self.pipeline = parallelize(self.model, self.rt, cfg)
        if self.tp_plan is None:
            self.token_loss = cross_entropy_per_token
        else:
            self.token_loss = partial(vocab_parallel_cross_entropy, plan=self.tp_plan, comm=comm)
        self.optimizer = build_optimizer(
            self.engine.optimizer_params(), t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay
        )
        self.tp_blocks = None
        if self.tp_plan is not None:
            at = self.dims.coords(rank)
            grid = self.dims.dense_grid[at["pp"], at["dp_replicate"], :, at["cp"], :]
            self.tp_blocks = TensorParallelBlocks(self.tp_plan, grid.tolist())
        self.start_step = resume_if_asked(cfg, self.engine, self.optimizer, self.sampler, self.tp_blocks)

        self.dp = self.rt.mesh.group("dp")
        # The tied embedding's copy on the last stage is the first stage's: its norm counts once.
        tied_copy = (
            self.pipeline is not None and self.pipeline.holds_tied_weight() and self.pipeline.is_last_stage()
        )
        self.counted_elsewhere = frozenset({TIED_WEIGHT} if tied_copy else ())
        self.global_tokens = t.global_batch * t.seq_len
        self.peak, self.peak_source = peak_flops(device, DTYPES[t.dtype])
        self.model_flops = flops_per_token(cfg.model, t.seq_len)

    def compute_gradients(self) -> torch.Tensor:
        """Forward and backward over this step's micro-batches, gradients synchronised; returns this
        rank's share of the mean cross-entropy."""
        t = self.cfg.training
        loss_sum = torch.zeros((), device=self.device)
        micro_batches = self.sampler.next_micro_batches(
            self.dataset, self.dp.rank, self.dp.size, t.micro_batch
        )
        if self.pipeline is not None:
            loss_sum = self.pipeline.run(
                [(inputs.to(self.device), targets.to(self.device)) for inputs, targets in micro_batches],
                self.global_tokens,
                self.token_loss,
                partial(autocast_context, self.device, t.dtype),
                before_grads=self.engine.prepare_micro_batch,
            )
            self.engine.finish_gradients()
            if self.pipeline.holds_tied_weight():
                sum_tied_gradients(self.engine, self.comm, self.rt.mesh.group(PP_ENDS))
            return self.comm.all_reduce_(loss_sum, self.rt.mesh.group("pp"))
        for index, (inputs, targets) in enumerate(micro_batches):
            self.engine.prepare_micro_batch(is_last=index == len(micro_batches) - 1)
            loss, ce = micro_batch_loss(
                self.model,
                inputs.to(self.device),
                targets.to(self.device),
                self.global_tokens,
                t.dtype,
                self.token_loss,
            )
            loss.backward()
            loss_sum += ce.detach()
        self.engine.finish_gradients()
        return loss_sum

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step (0-based `step`); returns its metrics row."""
        t = self.cfg.training
        start = time.perf_counter()
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = self.compute_gradients()
        grad_norm = clip_grad_norm_(
            self.engine,
            t.grad_clip,
            self.comm,
            self.tp_plan,
            self.rt.mesh.group("pp"),
            self.counted_elsewhere,
        )
        self.optimizer.step()
        self.engine.after_step()
        self.engine.zero_grad()
        self.comm.all_reduce_(loss_sum, self.dp)

        comm_bytes, comm_by_group = self.comm.stats.total_bytes(), self.comm.stats.by_group()
        self.comm.stats.reset()
        elapsed = time.perf_counter() - start
        tokens_per_sec = self.global_tokens / elapsed
        extra = {}
        if self.pipeline is not None:  # the mean over stages of the time each spent not computing
            bubble = torch.tensor(self.pipeline.idle_fraction(), dtype=torch.float64)
            extra["pp_bubble"] = float(self.comm.all_reduce_(bubble, self.rt.mesh.group("pp"), op="avg"))
            self.comm.stats.reset()
        return {
            "step": step + 1,
            "loss": float(loss_sum),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "mfu": self.model_flops * tokens_per_sec / (self.peak * self.rt.world_size),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes": comm_bytes,
            "step_time_s": elapsed,
            "comm_bytes_by_group": comm_by_group,
            **extra,
        }

    def close(self) -> None:
        """Release the process groups of this job's mesh if it made them (the world group stays)."""
        if self.owns_mesh:
            self.rt.mesh.close()

    def save(self, step: int) -> None:
        save_checkpoint(
            checkpoint_root(self.cfg),
            step,
            self.engine,
            self.optimizer,
            {"sampler": self.sampler.state_dict()},
            self.comm,
            self.rt.world,
            self.cfg.checkpoint.keep,
            self.tp_blocks,
        )

    def draw_pipeline_timeline(self, out_path: Path) -> None:
        """Collective over each pipeline: rank 0 draws its pipeline's last step as measured, next to the
        simulation of the schedule with the measured times."""
        timelines = self.comm.all_gather_object(self.pipeline.timeline, self.rt.mesh.group("pp"))
        if self.rt.rank != 0:
            return
        p = self.cfg.parallel
        path, measured, simulated = draw_measured_timeline(
            timelines,
            p.pp_schedule,
            p.vpp,
            self.cfg.training.global_batch // (self.cfg.training.micro_batch * self.dp.size),
            out_path,
        )
        print(
            f"meshtron: pipeline timeline of the last step in {path}: bubble {100 * measured:.1f}% measured, "
            f"{100 * simulated:.1f}% simulated with the measured compute times",
            flush=True,
        )

    def run(self) -> list[dict[str, Any]]:
        """All steps from the start (or resume) step; returns the metric rows (on rank 0; [] elsewhere)."""
        cfg, rank = self.cfg, self.rt.rank
        run_dir = Path(cfg.run.dir)
        logger = MetricsLogger(run_dir, enabled=rank == 0, append=self.start_step > 0)
        if rank == 0:
            print(
                f"meshtron: {self.n_params:,} parameters, world {self.rt.world_size} ({self.device.type}), "
                f"{self.dims.summary()}; MFU relative to {self.peak_source}",
                flush=True,
            )
        last = cfg.training.steps - 1
        for step in range(self.start_step, cfg.training.steps):
            row = self.step(step)
            logger.log(row)
            if rank == 0 and (step % cfg.run.log_every == 0 or step == last):
                print(MetricsLogger.console_line(row), flush=True)
            if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step == last):
                self.save(step + 1)
        if rank == 0 and cfg.run.plot and logger.rows:
            title = f"{cfg.model.name or run_dir.name}: {self.n_params:,} parameters, {self.dims.summary()}"
            plot_loss(logger.rows, run_dir / "loss.png", title)
        if cfg.run.plot and self.pipeline is not None and cfg.training.steps > self.start_step:
            self.draw_pipeline_timeline(run_dir / "pipeline-timeline.png")
        logger.close()
        return logger.rows


def train(cfg: Config, mesh: ParallelMesh | None = None) -> list[dict[str, Any]]:
    """Run cfg.training.steps optimizer steps; returns the metric rows (on rank 0; [] elsewhere)."""
    trainer = Trainer(cfg, mesh)
    try:
        return trainer.run()
    finally:
        trainer.close()
