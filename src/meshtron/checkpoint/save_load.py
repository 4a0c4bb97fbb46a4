"""Checkpoints through torch.distributed.checkpoint: every rank writes its own part, in parallel.

The state is that of every logical parameter, by name: its value and its AdamW moments, each as the
block of the logical tensor this rank holds, so a checkpoint written by one layout loads into any other
(e.g. ZeRO-3 on 4 ranks -> DDP on 2 -> 1 device; tp 2 x pp 2 -> tp 4). A block is

  - a DTensor sharded on dim 0 over dp_shard, for parameters whole on every tensor-parallel rank
    (their copies on the other tp ranks are the same entries, written once);
  - a plain tensor with explicit offsets (blocks.py, DCP's public planner API), for
    parameters split over tensor or expert parallel: the tp slice (along its split dim) holds the rows
    this rank owns over dp_shard; the vocabulary's padding rows are left out. (DTensor placements
    cannot say "tp outer, data parallel inner" on one dim when sizes do not divide evenly; explicit
    offsets can.)

A checkpoint is written into `step-NNNNNNNN.tmp/` and renamed to `step-NNNNNNNN/` only once every rank
has finished, so a crash mid-save leaves the previous checkpoint as the newest complete one. The state
holds the model (with MoE routers' balancing biases), the optimizer, the data sampler and the step, which
is all an exact resume needs
(the learning rate is a function of the step; the model has no dropout). Beside it, rank 0 writes the
files the trainer passes (the run's resolved `config.toml` and its `tokenizer.json`), so that one
directory is enough to rebuild the model on one device (`load_model_weights`, `meshtron export`).

`format.json` names the checkpoint format and the meshtron and torch versions that wrote it. Format 1
(no such file: meshtron before December 2026) wrote tp blocks as torch ShardedTensors; what it left on
disk is the same chunked metadata format 2 writes, so both load. A newer format is refused, by name.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

import meshtron
from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.blocks import Block, BlockLoadPlanner, BlockSavePlanner, KeyPath, ShardBlocks
from meshtron.checkpoint.integrity import write_manifest
from meshtron.checkpoint.safe_reader import SafeFileSystemReader
from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.config.schema import ModelConfig
from meshtron.engines.engine import DataParallelEngine, OwnedRows
from meshtron.models.llama import Transformer
from meshtron.models.rope import rope_inv_freq

STEP_DIR = re.compile(r"^step-(\d{8})$")
FORMAT = 2  # blocks.py's explicit-offset blocks (1: the same on disk, via ShardedTensor)
FORMAT_FILE = "format.json"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Finished checkpoints under root, oldest first (unfinished `.tmp` directories are ignored)."""
    if not root.is_dir():
        return []
    found = [
        CheckpointInfo(int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return sorted(found, key=lambda c: c.step)


def _wrap(local: torch.Tensor, entry: OwnedRows, mesh: Any) -> torch.Tensor:
    """This rank's rows as a DTensor sharded on dim 0 (a plain tensor when nothing is sharded), so DCP
    records where they sit in the logical tensor and any other layout can read them back."""
    if mesh is None or isinstance(local, DTensor):
        return local
    shape = torch.Size(entry.shape)
    return DTensor.from_local(
        local,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


def _optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optimizer's state for `param` (AdamW's step and moments, or Muon's momentum), created as a
    fresh optimizer would if it has not stepped yet."""
    state = optimizer.state[param]
    if not state and hasattr(optimizer, "fresh_state"):  # Muon with AdamW (train/muon.py)
        state.update(optimizer.fresh_state(param))
    elif not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


@dataclass(frozen=True)
class ReplicaState:
    """DiLoCo's (train/diloco.py): replicas whose weights and moments differ between outer steps. Replica
    `index` saves them under `name@replicaK` (replica 0 under the plain names, which export and init read),
    and `shared` (id of an owned-rows tensor -> {key: tensor of its rows}) the state every replica holds
    alike, under ("diloco", name, key)."""

    index: int
    shared: dict[int, dict[str, torch.Tensor]]


def _state(
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    tp_blocks: ShardBlocks | None,
    replica: ReplicaState | None = None,
) -> tuple[dict[str, Any], dict[KeyPath, Block | None]]:
    """The state to save or load into (views of the live tensors), and where each tp/ep block sits."""
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, dict[str, torch.Tensor]] = {}
    shared_sd: dict[str, dict[str, torch.Tensor]] = {}
    blocks: dict[KeyPath, Block | None] = {}
    own = f"@replica{replica.index}" if replica is not None and replica.index else ""
    for entry in engine.owned_rows():
        rows, name = slice(0, entry.rows), entry.name + own
        state = _optimizer_state(optimizer, entry.param)
        optim_sd[name] = {"step": state["step"]} if "step" in state else {}
        values = {("model", name): entry.param.detach()[rows]}
        for key, tensor in state.items():  # the moments, or the momentum: rows like the parameter's
            if key != "step":
                values["optimizer", name, key] = tensor[rows]
        if replica is not None:
            shared_sd[entry.name] = {}
            for key, tensor in replica.shared[id(entry.param)].items():
                values["diloco", entry.name, key] = tensor[rows]
        for key, local in values.items():
            if tp_blocks is not None and tp_blocks.holds(entry.name):
                # Under torch's fully_shard the tp shard is a DTensor over dp_shard_cp, cut in the same
                # row blocks as meshtron's engines (torch.chunk's): its local rows are the block's.
                local = local.to_local() if isinstance(local, DTensor) else local
                local, blocks[key] = tp_blocks.place(local, entry)
            elif entry.row_shape:  # a stack cut within its matrices: a box Shard(0) cannot say
                offsets, sizes = entry.box()
                local, blocks[key] = local.view(sizes), Block(tuple(offsets), tuple(sizes), entry.shape)
            else:
                local = _wrap(local, entry, engine.shard_mesh)
            part = {"model": model_sd, "optimizer": optim_sd, "diloco": shared_sd}[key[0]]
            (part if key[0] == "model" else part[key[1]])[key[-1]] = local
    # Auxiliary-loss-free balancing biases: the same on every rank holding their layer (saved once).
    model_sd.update({n: b for n, b in engine.model.named_buffers() if n.endswith("expert_bias")})
    # Plain numbers as tensors: DCP stores other values with pickle (safe_reader.py).
    train = {k: {n: torch.tensor(v) for n, v in part.items()} for k, part in train_state.items()}
    out = {"model": model_sd, "optimizer": optim_sd, "train": train}
    return ({**out, "diloco": shared_sd} if replica is not None else out), blocks


@dataclass(kw_only=True)
class SaveRequest:
    """One checkpoint to write: where, after which step, what, and over which ranks."""

    root: Path  # the checkpoints directory; this one goes into root/step-NNNNNNNN
    step: int
    engine: DataParallelEngine
    optimizer: torch.optim.Optimizer
    train_state: dict[str, Any]  # {part: {name: number}}: the sampler's position
    comm: Comm
    world: CommGroup
    keep: int  # newest checkpoints kept (0: all)
    tp_blocks: ShardBlocks | None = None
    files: dict[str, bytes] | None = None  # name -> contents, written by rank 0 inside the manifest
    replica: ReplicaState | None = None  # DiLoCo's replicas, each with its own weights and moments


def save_checkpoint(request: SaveRequest) -> Path:
    """Collective: every rank must call it. Returns the final directory. Refuses (on every rank) to write
    parameters or optimizer state holding inf or NaN."""
    tmp, state, blocks = prepare_save(request)
    dcp.save(state, checkpoint_id=str(tmp), planner=BlockSavePlanner(blocks))
    return publish(tmp, request, request.comm, request.world)


def prepare_save(request: SaveRequest) -> tuple[Path, dict[str, Any], dict[KeyPath, Block | None]]:
    """Collective: the state to write (refused if non-finite), where its blocks sit, and the empty
    directory `step-NNNNNNNN.tmp` to write it into."""
    r, comm, world, root = request, request.comm, request.world, request.root
    tmp = root / f"step-{r.step:08d}.tmp"
    state, blocks = _state(r.engine, r.optimizer, r.train_state, r.tp_blocks, r.replica)
    bad = sorted({n for part in comm.all_gather_object(_non_finite(state), world) for n in part})
    if bad:
        final = root / f"step-{r.step:08d}"
        raise CheckpointError(f"refusing to write checkpoint {final}: non-finite values in {', '.join(bad)}")
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save of this step
    comm.barrier(world)
    return tmp, state, blocks


def publish(tmp: Path, request: SaveRequest, comm: Comm, world: CommGroup) -> Path:
    """Collective over `world`, once every rank has written its part into `tmp`: the format record and
    the request's files, the manifest, then the rename that makes it the newest complete checkpoint, and
    the oldest ones beyond `keep` removed. Returns the final directory. (`comm` and `world` are the
    request's, or a background writer's own.)"""
    final, root, keep = tmp.with_name(tmp.name.removesuffix(".tmp")), request.root, request.keep
    if world.rank == 0:
        (tmp / FORMAT_FILE).write_text(_format_record())
        for name, contents in (request.files or {}).items():
            (tmp / name).write_bytes(contents)
    comm.barrier(world)
    write_manifest(tmp, comm, world)
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old.path, ignore_errors=True)
    comm.barrier(world)
    return final


def _format_record() -> str:
    return json.dumps({"format": FORMAT, "meshtron": meshtron.__version__, "torch": torch.__version__})


def check_format(path: Path) -> None:
    """Refuse a checkpoint in a format newer than this meshtron reads, naming who wrote it."""
    record = path / FORMAT_FILE
    if not record.is_file():
        return  # format 1
    try:
        written = json.loads(record.read_text())
        version = int(written["format"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: {FORMAT_FILE} is unreadable ({err})") from None
    if version > FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in format {version}, written by meshtron {written.get('meshtron')} "
            f"(torch {written.get('torch')}); this meshtron ({meshtron.__version__}) reads formats 1 to "
            f"{FORMAT}: upgrade meshtron to load it"
        )


def _non_finite(state: dict[str, Any]) -> list[str]:
    """Names of this rank's model and optimizer tensors holding inf or NaN."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [(n, local(t)) for n, t in state["model"].items()]
    tensors += [
        (f"{n} ({k})", local(t)) for n, s in state["optimizer"].items() for k, t in s.items() if k != "step"
    ]
    tensors = [(n, t) for n, t in tensors if t.is_floating_point() and t.numel() > 0]
    if not tensors:
        return []
    # Each tensor's min and max in one pass (inf shows there, NaN propagates; 10x faster than isfinite's
    # mask on a CPU), all read back at once.
    extremes = torch.stack([torch.stack(torch.aminmax(t.detach())).float() for _, t in tensors])
    finite = torch.isfinite(extremes).all(dim=1).tolist()
    return [name for (name, _), ok in zip(tensors, finite, strict=True) if not ok]


def load_checkpoint(
    path: Path,
    engine: DataParallelEngine,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    tp_blocks: ShardBlocks | None = None,
    replica: ReplicaState | None = None,
) -> dict[str, Any]:
    """Load `path` (written by any layout) into this layout in place; returns the saved train state."""
    state, blocks = _state(engine, optimizer, train_state, tp_blocks, replica)
    check_format(path)
    try:
        # Read first on its own: inside dcp.load a refused metadata file is taken for a missing one.
        metadata = SafeFileSystemReader(str(path)).read_metadata()
        _same_optimizer(path, metadata, state["optimizer"])
        _same_replicas(path, metadata, replica)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=BlockLoadPlanner(blocks))
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {path} is not a meshtron checkpoint: {err}") from None
    except (CheckpointException, RuntimeError, ValueError) as err:
        # DCP wraps per-rank failures (in a BaseException); keep the line that names the tensor.
        lines = [line for line in str(err).splitlines() if "Error" in line or "mismatch" in line.lower()]
        detail = lines[-1].strip() if lines else str(err).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model and optimizer: {detail}. "
            "Resume with the config it was written with, or start a new run.dir"
        ) from None
    engine.load_owned_rows()
    return state["train"]


def _same_optimizer(path: Path, metadata: Any, optimizer_sd: dict[str, dict[str, Any]]) -> None:
    """Refuse a checkpoint whose optimizer (AdamW, or Muon with AdamW) is not this run's: its state
    would not fit, and silently fresh moments would change the training."""

    def muon(keys: Any) -> bool:
        return any(str(k).endswith("momentum_buffer") for k in keys)

    saved = muon(metadata.state_dict_metadata)
    ours = muon(k for part in optimizer_sd.values() for k in part)
    if saved != ours:
        name = {True: "'muon'", False: "'adamw'"}
        raise CheckpointError(
            f"checkpoint {path} was written with training.optimizer={name[saved]}, and this run has "
            f"{name[ours]}: an optimizer's state does not carry over to another; resume with "
            f"training.optimizer={name[saved]}, or start a new run.dir (init_from for the weights alone)"
        )


def _same_replicas(path: Path, metadata: Any, replica: ReplicaState | None) -> None:
    """Refuse a checkpoint without DiLoCo's state, or without this replica's weights, under DiLoCo."""
    if replica is None:
        return
    keys = [str(k) for k in metadata.state_dict_metadata]
    mine = f"@replica{replica.index}"
    if not any(k.startswith("diloco.") for k in keys) or (replica.index and not any(mine in k for k in keys)):
        raise CheckpointError(
            f"checkpoint {path} holds no DiLoCo state for replica {replica.index} (written without "
            "fault_tolerance.diloco_every, or with fewer dp_replicate replicas): resume with the settings "
            "it was written with, or start a new run.dir (init_from for the weights alone)"
        )


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Fill a single-device model in place from checkpoint `path` (written by any layout), in this
    process alone: no process group is needed, and none is used if one exists. Only the model's
    entries are read (not the optimizer's); each is assembled from the row and tp/ep blocks it was
    saved as."""
    check_format(path)
    state = {"model": model.state_dict()}
    try:
        SafeFileSystemReader(str(path)).read_metadata()  # refused metadata named, not taken for missing
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {path} is not a meshtron checkpoint: {err}") from None
    except (CheckpointException, RuntimeError, ValueError) as err:
        lines = [line for line in str(err).splitlines() if "Error" in line or "mismatch" in line.lower()]
        detail = lines[-1].strip() if lines else str(err).splitlines()[0]
        raise CheckpointError(f"checkpoint {path} does not fit this model: {detail}") from None


def read_model_tensor(path: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Logical parameter `name` (of `shape`, fp32) from checkpoint `path` (written by any layout), in
    this process alone, reading only that parameter's blocks: what `meshtron export` streams."""
    tensor = torch.empty(shape)
    state = {"model": {name: tensor}}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    except (CheckpointException, RuntimeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} has no parameter {name} of shape {list(shape)}: {err}"
        ) from None
    return tensor


def checkpoint_model(path: Path, cfg: ModelConfig) -> Transformer:
    """The single-device model checkpoint `path` holds, whatever layout wrote it: fp32 (the master
    weights), on the CPU."""
    with torch.device("meta"):  # no time spent initialising weights the checkpoint overwrites
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    for name, buffer in model.named_buffers():
        if name.endswith("loads_2E"):
            buffer.zero_()  # expert load counters: not state, they start from nothing
    model.rope_inv_freq = rope_inv_freq(cfg)  # computed, never stored
    load_model_weights(path, model)
    return model
