"""A training job's set-up on this rank, everything before its first step, in order:

  1  process group    join the job torchrun (or `--nproc`) started, or make a one-rank job
  2  check            the config against the world size and device the job really has (rules/checks.py)
  3  directories      run.dir (and checkpoint.dir) writable, found before any work
  4  mesh, comm       this layout's process groups (comm/mesh.py) and the communication layer (comm/collectives.py)
  5  records          config.toml and environment.json in run.dir (observe/records.py), before the long phases
  6  data             the prepared tokens (rank 0 prepares the default corpus), the validation split,
                      the layout-independent sampler
  7  model            built on the meta device: its structure, no storage for its parameters
  8  parallelize      every parallelism applied, one step each (parallel/parallelize.py); the engine gives
                      storage to what this rank holds, and nothing else
  9  optimizer        AdamW over what the data-parallel engine says to optimise
 10  resume           the newest intact checkpoint, with checkpoint.resume or after a restart
 11  init_from        else a Hugging Face checkpoint's weights, each rank reading its slices
 12  initialise       else the seeded initialisation, each rank drawing only its regions (regions.py,
                      models/init.py): the single-device run's values, whatever the layout

`set_up` returns a `Job`; trainer.py runs its steps.
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

from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.blocks import ShardBlocks
from meshtron.checkpoint.integrity import corrupt_files, unwritable
from meshtron.checkpoint.save_load import CheckpointInfo, complete_checkpoints, load_checkpoint
from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.comm.record import recorder
from meshtron.config.layout import Dim, ParallelDims
from meshtron.config.schema import Config, ConfigError, TrainingDType, refuse
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, default_dataset
from meshtron.data.mixture import Mixture, MixtureSampler
from meshtron.data.sampler import BatchSampler
from meshtron.data.tokenizer import TOKENIZER_FILE
from meshtron.data.validation import split_validation
from meshtron.hf.init_from import LoadReport, load_hf_weights
from meshtron.models.documents import DocumentMask
from meshtron.models.llama import Transformer, build_meta_model
from meshtron.models.loss import MicroBatchLoss
from meshtron.observe.records import write_run_records
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.parallelize import ParallelModel, parallelize
from meshtron.parallel.regions import initialize_
from meshtron.plan.state import layer_split
from meshtron.probe.cluster import ranks_per_node, run_exchange
from meshtron.rules.checks import check
from meshtron.rules.training import float8_device_problems
from meshtron.train.diloco import OuterStep, make_outer_step
from meshtron.train.fault_tolerance import (
    GROUP_ENV,
    FaultTolerance,
    ReplicaShare,
    join_replica_groups,
    replica_config,
    slot_from_env,
)
from meshtron.train.muon import make_optimizer
from meshtron.utils.resident import release_freed_memory
from meshtron.utils.words import plural


@dataclass(kw_only=True)
class RankPlace:
    """Where this process sits in the job: its rank, device, mesh and communication layer."""

    rank: int
    world_size: int
    device: torch.device
    mesh: ParallelMesh
    comm: Comm
    world: CommGroup


@dataclass(kw_only=True)
class Job:
    """What one training job holds on this rank once set up."""

    cfg: Config
    place: RankPlace
    dims: ParallelDims
    owns_mesh: bool  # made its process groups (else it reuses a caller's mesh, which keeps them)
    environment: dict[str, Any] | None  # what observe/records.py wrote (rank 0)
    dataset: PreparedData | Mixture  # the training tokens (one dataset, or a mixture: data.sources)
    val_data: PreparedData | Mixture | None  # the validation tokens, if any
    sampler: BatchSampler | MixtureSampler | ReplicaShare
    model: Transformer  # this rank's part of the model
    n_params: int  # the whole model's
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    outer: OuterStep | None  # DiLoCo's outer loop (fault_tolerance.diloco_every), else None
    replicas: FaultTolerance | None  # this replica group's part (fault_tolerance.enabled), else None
    loss: MicroBatchLoss
    documents: DocumentMask | None  # data.document_mask: attention within documents (train/micro_batches.py)
    tp_blocks: ShardBlocks | None  # where tensor- and expert-parallel shards sit, for checkpoints
    start_step: int = 0
    resumed_from: Path | None = None  # the checkpoint loaded, which takes precedence over init_from
    init_report: LoadReport | None = None  # what this rank read of model.init_from
    started: float = 0.0  # perf_counter at the start of set-up: the summary's wall time counts it


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


def open_dataset(cfg: Config, place: RankPlace) -> PreparedData | Mixture:
    """The training data; rank 0 prepares the default corpus on first use while the others wait."""
    if cfg.data.sources:
        dataset = _open_mixture(cfg)
    elif cfg.data.path != "default":
        dataset = PreparedData.open(cfg.data.path)
    else:
        if place.rank == 0:
            dataset = default_dataset(
                tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab, say=partial(say, 0)
            )
        place.comm.barrier(place.world)
        if place.rank != 0:
            dataset = default_dataset(tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab)
    _check_vocab(cfg, dataset)
    return dataset


def _open_mixture(cfg: Config) -> Mixture:
    sources = cfg.data.sources
    return Mixture.open([x.path for x in sources], [x.weight for x in sources])


def _check_vocab(cfg: Config, dataset: PreparedData | Mixture) -> None:
    have, model = dataset.vocab_size, cfg.model
    if have <= model.vocab_size:
        return
    says = f"the dataset's vocabulary has {have} tokens but model.vocab_size={model.vocab_size}"
    if not model.init_from:
        raise DataError(f"{says}; set --model.vocab_size={have} or larger")
    # The checkpoint fixes the vocabulary (its embedding's rows): the data must change, not the model.
    init_from = Path(model.init_from)
    tokenizer = init_from / TOKENIZER_FILE
    given = (
        str(tokenizer)
        if tokenizer.is_file()
        else f"TOKENIZER.json (the checkpoint's own tokenizer; {init_from} has no {TOKENIZER_FILE})"
    )
    raise DataError(
        f"{says}, from model.init_from={str(init_from)!r}: the data was tokenized with another tokenizer "
        f"than the checkpoint's; tokenize it with the checkpoint's: meshtron prepare-data YOUR_TEXTS "
        f"--out DIR --tokenizer {given}, and set data.path=DIR"
        + (" (each of data.sources so prepared)" if cfg.data.sources else "")
    )


def check_data(cfg: Config) -> None:
    """What step 6 would refuse about a prepared dataset (its path, metadata, vocabulary against the
    model's, the validation split), found before any rank starts; raises DataError. The default corpus
    is prepared by the ranks on first use and is checked there."""
    if cfg.data.sources or cfg.data.path != "default":  # memory-mapped: nothing read but the metadata
        dataset = _open_mixture(cfg) if cfg.data.sources else PreparedData.open(cfg.data.path)
        _check_vocab(cfg, dataset)
        split_validation(cfg, dataset)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"


def autocast_context(device: torch.device, dtype: TrainingDType) -> contextlib.AbstractContextManager:
    """bf16 autocast over fp32 master weights (also under fp8, around its float8 layers), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype != "fp32" else contextlib.nullcontext()


def _join(cfg: Config, mesh: ParallelMesh | None) -> tuple[RankPlace, ParallelDims]:
    """Steps 1-4: the process group, the checked config, writable directories, the mesh and comm layer.
    `mesh`: reuse the process groups of an earlier job with the same layout in this process."""
    rank, world_size, device = init_distributed(cfg)
    # First, so that any report of a problem says which torch and backend ran it.
    say(
        rank,
        f"torch {torch.__version__}, {dist.get_backend()} backend, {plural(world_size, 'rank')} on {device.type}",
    )
    check(cfg, world_size, device.type)
    if cfg.training.dtype == "fp8" and device.type == "cuda":
        refuse(float8_device_problems(torch.cuda.get_device_capability(device)))
    for directory in [Path(cfg.run.dir)] + ([checkpoint_root(cfg)] if cfg.checkpoint.every else []):
        why = unwritable(directory, rank)
        if why:  # found before any work, not at the first checkpoint
            raise CheckpointError(f"{why}; set run.dir (or checkpoint.dir) to a directory this job can write")
    dims = cfg.parallel.dims(world_size)
    if mesh is not None and mesh.dims != dims:
        raise ValueError(f"the given mesh is {mesh.dims.summary()}, the config asks for {dims.summary()}")
    comm = Comm(cfg.run.comm_timeout_s)
    comm.ranks_per_node = cfg.run.gpus_per_node or ranks_per_node(world_size)
    world = comm.group("world", list(range(world_size)), dist.group.WORLD)
    place = RankPlace(
        rank=rank,
        world_size=world_size,
        device=device,
        mesh=mesh or ParallelMesh(dims, device.type),
        comm=comm,
        world=world,
    )
    return place, dims


def _resolve_exchange(cfg: Config, place: RankPlace) -> Config:
    """parallel.cp_exchange = "auto" made the planner's choice for this run's hardware (probe/cluster.py
    `run_exchange`); said when it is a choice (MLA under a ring or all-gather)."""
    chosen = run_exchange(cfg, place.world_size)
    if chosen is not cfg:
        exchange = chosen.parallel.cp_exchange
        say(
            place.rank,
            f"parallel.cp_exchange='auto': '{exchange}' (the planner's faster step on this hardware)",
        )
    return chosen


def set_up(cfg: Config, mesh: ParallelMesh | None = None) -> Job:
    """Steps 1-11 above on this rank (collective over the job); `mesh` as in `_join`."""
    started = time.perf_counter()
    whole, grouped = cfg, cfg.fault_tolerance.enabled  # a replica group runs a job of its own
    if grouped:  # (train/fault_tolerance.py)
        slot_from_env()  # (refused before anything starts when the launcher did not say which group)
        cfg = replica_config(cfg)
    place, dims = _join(cfg, mesh)
    cfg = _resolve_exchange(cfg, place)
    rank, t = place.rank, cfg.training
    # Before the long phases, so that a run dying in start-up still says what it was (observe/records.py).
    records = rank == 0 and os.environ.get(GROUP_ENV, "0") == "0"
    world_size = place.world_size * whole.parallel.dp_replicate if grouped else place.world_size
    environment = write_run_records(cfg.run.dir, whole, world_size) if records else None
    torch.manual_seed(t.seed)
    # With data.val_fraction, training samples only the tokens before the held-out tail.
    dataset, val_data = split_validation(cfg, open_dataset(cfg, place))
    if isinstance(dataset, Mixture):
        sampler: Any = MixtureSampler(dataset, t.seq_len, t.global_batch, t.seed)
    else:
        sampler = BatchSampler(dataset.n_tokens, t.seq_len, whole.training.global_batch, t.seed)
        if grouped:  # the group's share of each global batch
            sampler = ReplicaShare(sampler, int(os.environ[GROUP_ENV]), whole.parallel.dp_replicate)
    m = cfg.model
    model_says = f"{m.name or 'custom'}: {m.n_layers} layers, dim {m.dim}, on {place.device.type}"
    say(rank, f"building the model ({model_says}) and parallelizing it: {dims.summary()}")
    model = build_meta_model(cfg.model, place.device)
    n_params = model.num_params()
    parallel = parallelize(model, place.comm, place.mesh, cfg, layer_split(cfg), place.device)
    # data.document_mask: attention within documents, whose end token is the data's.
    documents = DocumentMask(dataset.eos_id, cfg.data.reset_positions) if cfg.data.document_mask else None
    optimizer = make_optimizer(parallel.engine, place.comm, cfg, parallel.tp_plan)
    outer = make_outer_step(parallel.engine, place.comm, place.mesh, cfg)  # DiLoCo, if asked
    autocast = partial(autocast_context, place.device, t.dtype)
    mtp_coef = t.mtp_loss_coef if cfg.model.mtp_depth else 0.0
    loss = MicroBatchLoss(parallel.token_loss, t.global_batch * t.seq_len, autocast, mtp_coef)
    experts = expert_parameter_names(model) if dims.experts_apart else frozenset()
    tp_blocks = None
    if parallel.tp_plan is not None or experts:
        at = dims.coords(place.rank)
        tp_blocks = ShardBlocks(
            parallel.tp_plan,
            place.mesh.grid(Dim.DP_SHARD_CP, Dim.TP),
            ep=dims.ep,
            experts=experts,
            expert_place=(at[Dim.EP], at[Dim.EDP], dims.edp),
        )
    job = Job(
        cfg=cfg,
        place=place,
        dims=dims,
        owns_mesh=mesh is None,
        environment=environment,
        dataset=dataset,
        val_data=val_data,
        sampler=sampler,
        model=model,
        n_params=n_params,
        parallel=parallel,
        optimizer=optimizer,
        outer=outer,
        replicas=None,
        loss=loss,
        documents=documents,
        tp_blocks=tp_blocks,
        started=started,
    )
    resume_if_asked(job)
    if job.resumed_from is None:  # a resumed run keeps its own weights
        _initialise(job)
        if job.outer is not None:
            job.outer.start_from_weights()
    if grouped:
        job.replicas = join_replica_groups(job, whole)
    # What start-up freed (the build's, a checkpoint's or the initialisation's temporaries) goes back to
    # the system rather than staying in malloc's arenas until the steps happen to reuse it.
    release_freed_memory()
    return job


def _initialise(job: Job) -> None:
    """Steps 11-12: this rank's parameters from model.init_from, else the seeded initialisation."""
    cfg, place, parallel = job.cfg, job.place, job.parallel
    ep = place.mesh.group(Dim.EP)
    if cfg.model.init_from:
        say(place.rank, f"loading the Hugging Face checkpoint {cfg.model.init_from}")
        job.init_report = load_hf_weights(cfg.model.init_from, parallel, cfg.model, ep, place.world)
        read = job.init_report.elements
        say(place.rank, f"initialised from {cfg.model.init_from} ({read:,} values read by rank 0)")
        if job.init_report.skipped_mtp:
            layers = ", ".join(map(str, job.init_report.skipped_mtp))
            say(
                place.rank,
                f"note: the checkpoint's multi-token prediction module(s) (layer {layers}) not read: "
                f"model.mtp_depth={cfg.model.mtp_depth}; set model.mtp_depth to train them",
            )
    else:
        initialize_(parallel, cfg.model, cfg.training.seed, ep)


def earlier_run(cfg: Config, metrics: bool = True) -> str | None:
    """Why a new run (not checkpoint.resume) must not start over run.dir: an earlier run's checkpoints,
    which it would overwrite, or (`metrics`) its metrics.jsonl rows with no checkpoint, which it would
    replace; None when there is neither. `meshtron train` asks before any rank starts (commands/train.py);
    a launched job's ranks ask again after a restart is ruled out."""
    root = checkpoint_root(cfg)
    if existing := complete_checkpoints(root):
        return (
            f"{root} already holds checkpoints (newest: step {existing[-1].step}); set "
            "--checkpoint.resume=true to continue from it, or use another run.dir / checkpoint.dir"
        )
    path = Path(cfg.run.dir) / "metrics.jsonl"
    rows = (
        sum(1 for line in path.read_text().splitlines() if line.strip()) if metrics and path.is_file() else 0
    )
    if not rows:
        return None
    return (
        f"{path} already holds {rows} rows of an earlier run, and no checkpoint to continue from; a new run "
        "would replace them: use another run.dir, delete the file to start afresh here, or set "
        "--checkpoint.resume=true to start again from step 1 over them"
    )


def resume_if_asked(job: Job) -> None:
    """Set the step to start from: the newest intact checkpoint's with checkpoint.resume or after the
    launcher restarted the ranks (a rank died), else 0. Starting afresh over existing checkpoints is
    refused so that they are never overwritten by accident."""
    place, root = job.place, checkpoint_root(job.cfg)
    existing = complete_checkpoints(root)
    restarted = False
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a node whose ranks did not fail keeps its count
        restarts = torch.tensor([int(os.environ["TORCHELASTIC_RESTART_COUNT"])])
        restarted = int(place.comm.all_reduce_(restarts, place.world, op="max")) > 0
    if not (job.cfg.checkpoint.resume or restarted):
        # Under a launcher (torchrun's ranks are the first to see run.dir) an earlier run's metrics too.
        problem = earlier_run(job.cfg, metrics="TORCHELASTIC_RUN_ID" in os.environ)
        if problem:
            raise CheckpointError(problem)
        return
    if not existing:
        return
    newest = intact_checkpoint(existing, place)
    say(place.rank, f"loading checkpoint {newest.path}")
    state = {"sampler": job.sampler.state_dict()}
    engine = job.parallel.engine
    replica = job.outer.replica_state() if job.outer is not None else None  # DiLoCo's
    train_state = load_checkpoint(newest.path, engine, job.optimizer, state, job.tp_blocks, replica)
    job.sampler.load_state_dict(train_state["sampler"])  # its next step is the step to resume at
    job.resumed_from, job.start_step = newest.path, job.sampler.step
    say(place.rank, f"resumed from {newest.path} at step {job.sampler.step}")


def intact_checkpoint(existing: list[CheckpointInfo], place: RankPlace) -> CheckpointInfo:
    """The newest of `existing` whose files match their manifest; each corrupt one skipped with a warning
    that names its files."""
    for i in range(len(existing) - 1, -1, -1):
        info = existing[i]
        problems = corrupt_files(info.path, place.comm, place.world)
        if not problems:
            return info
        then = (
            f"falling back to the previous one, {existing[i - 1].path.name}" if i else "no older one is left"
        )
        say(place.rank, f"warning: checkpoint {info.path} is corrupt ({'; '.join(problems)}); {then}")
    where = existing[-1].path.parent
    which = (
        f"the only checkpoint in {where} is"
        if len(existing) == 1
        else f"all {len(existing)} checkpoints in {where} are"
    )
    raise CheckpointError(f"{which} corrupt; start a new run.dir, or restore one")
