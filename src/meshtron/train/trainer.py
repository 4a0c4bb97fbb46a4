"""The training loop: build the model -> parallelize -> optimizer -> steps, readable top to bottom."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtron.comm import Comm, CommGroup
from meshtron.config import Config, ConfigError, TrainingConfig, check
from meshtron.mesh import ParallelDims, ParallelMesh
from meshtron.models.llama import Transformer, build_model
from meshtron.parallel import data as data_parallel
from meshtron.train.checkpoint import CheckpointError, complete_checkpoints, load_checkpoint, save_checkpoint
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


def ensure_implemented(dims: ParallelDims) -> None:
    """Layouts the config accepts but this version cannot run yet are refused before any work starts."""
    missing = {
        "tp": "tensor parallel",
        "cp": "context parallel",
        "pp": "pipeline parallel",
        "ep": "expert parallel",
        "dp_shard": "sharded data parallel (ZeRO/FSDP)",
    }
    problems = [
        f"parallel.{dim}={dims.size(dim)}: {what} is not implemented yet; use parallel.{dim}=1"
        + (" and parallel.dp_replicate for data parallelism" if dim == "dp_shard" else "")
        for dim, what in missing.items()
        if dims.size(dim) > 1
    ]
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


def build_optimizer(model: nn.Module, t: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases or 1-D gains)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)


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
    cfg: Config, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: BatchSampler
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
    train_state = load_checkpoint(existing[-1].path, model, optimizer, {"sampler": sampler.state_dict()})
    sampler.load_state_dict(train_state["sampler"])  # the sampler's next step is the step to resume at
    if dist.get_rank() == 0:
        print(f"meshtron: resumed from {existing[-1].path} at step {sampler.step}", flush=True)
    return sampler.step


def parallelize(model: Transformer, rt: Runtime) -> Transformer:
    """Apply the parallelisms in a fixed order; today only replication over dp_replicate."""
    data_parallel.broadcast_parameters(model, rt.comm, rt.mesh.group("dp"))
    return model


def micro_batch_loss(
    model: Transformer, inputs: torch.Tensor, targets: torch.Tensor, global_tokens: int, dtype: str
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
    ce_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    ce = ce_sum / global_tokens
    # The aux loss is a per-micro-batch mean; weight it by this micro-batch's share of the tokens.
    return ce + aux_loss.float() * (targets.numel() / global_tokens), ce


def train(cfg: Config) -> list[dict[str, Any]]:
    """Run cfg.training.steps optimizer steps; returns the metric rows (on rank 0; [] elsewhere)."""
    rank, world_size, device = init_distributed(cfg)
    check(cfg, world_size)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    ensure_implemented(dims)
    comm = Comm(cfg.run.comm_timeout_s)
    mesh = ParallelMesh(dims, device.type)
    rt = Runtime(
        rank, world_size, device, mesh, comm, comm.group("world", list(range(world_size)), dist.group.WORLD)
    )
    t = cfg.training
    torch.manual_seed(t.seed)

    dataset = open_dataset(cfg, rt)
    if dataset.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the dataset's vocabulary has {dataset.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}; set --model.vocab_size={dataset.vocab_size} or larger"
        )
    sampler = BatchSampler(dataset.n_tokens, t.seq_len, t.global_batch, t.seed)

    model = parallelize(build_model(cfg.model, seed=t.seed, device=device), rt)
    optimizer = build_optimizer(model, t)

    run_dir = Path(cfg.run.dir)
    start_step = resume_if_asked(cfg, run_dir, model, optimizer, sampler)
    logger = MetricsLogger(run_dir, enabled=rank == 0, append=start_step > 0)
    dp_group = mesh.group("dp")
    dp_rank, dp_size = dp_group.rank, dp_group.size
    global_tokens = t.global_batch * t.seq_len
    compute_dtype = torch.bfloat16 if t.dtype == "bf16" else torch.float32
    peak, peak_source = peak_flops(device, compute_dtype)
    model_flops = flops_per_token(cfg.model, t.seq_len)
    if rank == 0:
        print(
            f"meshtron: {model.num_params():,} parameters, world {world_size} ({device.type}), "
            f"{dims.summary()}; MFU relative to {peak_source}",
            flush=True,
        )

    for step in range(start_step, t.steps):
        start = time.perf_counter()
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in sampler.next_micro_batches(dataset, dp_rank, dp_size, t.micro_batch):
            loss, ce = micro_batch_loss(model, inputs.to(device), targets.to(device), global_tokens, t.dtype)
            loss.backward()
            loss_sum += ce.detach()
        data_parallel.all_reduce_gradients(model, comm, dp_group)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        comm.all_reduce_(loss_sum, dp_group)

        step_comm_bytes = comm.stats.total_bytes()
        comm.stats.reset()
        elapsed = time.perf_counter() - start
        tokens_per_sec = global_tokens / elapsed
        row = {
            "step": step + 1,
            "loss": float(loss_sum),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "mfu": model_flops * tokens_per_sec / (peak * world_size),
            "peak_mem_bytes": peak_memory_bytes(device),
            "comm_bytes": step_comm_bytes,
            "step_time_s": elapsed,
        }
        logger.log(row)
        if rank == 0 and (step % cfg.run.log_every == 0 or step == t.steps - 1):
            print(MetricsLogger.console_line(row), flush=True)
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step == t.steps - 1):
            save_checkpoint(
                checkpoint_root(cfg),
                step + 1,
                model,
                optimizer,
                {"sampler": sampler.state_dict()},
                comm,
                rt.world,
                cfg.checkpoint.keep,
            )

    if rank == 0 and cfg.run.plot and logger.rows:
        plot_loss(
            logger.rows,
            run_dir / "loss.png",
            f"{cfg.model.name or run_dir.name}: {model.num_params():,} parameters, {dims.summary()}",
        )
    logger.close()
    return logger.rows
