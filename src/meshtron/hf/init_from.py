"""`model.init_from = "DIR"`: a run starts from a Hugging Face checkpoint, in whatever layout it uses.

DIR is a directory as transformers writes it: config.json and model.safetensors, or safetensors shards
with model.safetensors.index.json (pickled weights are refused, as by `meshtron.hf.load`).

The config: resolve.py reads the architecture from DIR/config.json while the config is merged.

The weights (`load_hf_weights`, called by the Trainer after `parallelize`): each rank asks its
data-parallel engine which rows of which parameters it holds (`owned_rows`, as checkpoints do), turns
them into a region of the logical tensor and reads exactly that region from the safetensors file
(`get_slice`: a memory map, so the bytes of other rows and tensors are never read):

  pipeline       a stage's engine lists only its chunks' parameters; the other layers are never read
  tensor         a parameter split over tp (tp_plan.split_dims) is read at this tp rank's columns or
                 rows; the vocabulary's padding rows are left as they are (zeros); key/value heads
                 replicated because there are fewer than tp are read whole
  expert         ep rank e holds the e-th block of the experts tensor parallel left it (with etp = 1,
                 tp rank t's E/tp experts first): only those experts' tensors are read
  context        cp ranks hold the same weights (FSDP shards them over dp_shard x cp like dp_shard)
  DDP            whole parameters (each replica reads what it holds: everything)
  ZeRO-1/2       the rows this rank's optimizer owns; `load_owned_rows` then all-gathers the whole
                 parameters, as after a step
  ZeRO-3         this rank's row block of each parameter (its fp32 master shard); the padding rows of
                 the last block stay zero
  fully_shard    the local shard of each DTensor, placed by its own device mesh and placements

Why after `parallelize` rather than into the whole model before it: the trainer builds every rank's
model whole and cuts it (so the build's peak is that of the seeded model, not the loader's); reading the
checkpoint into the whole model would make every rank read every tensor in full. After the cut, a rank
reads at most its own slice of one parameter at a time, so what the loader adds to a rank's memory is
bounded by its largest slice, and the bytes read over all ranks are about the checkpoint's size times the
replication of each parameter (tp-replicated norms and routers, dp_replicate), not times the world size.

Every rank reads DIR: on several nodes it must sit at the same path on each (a shared filesystem, or
a copy per node).

Resuming wins: the Trainer loads these weights only when it did not resume from a meshtron checkpoint
(a resumed run continues its own, already fine-tuned weights; DIR is then read for its config only).

Problems (a missing or misshapen tensor, a tied lm_head that differs from the embedding) are gathered
from every rank before anyone raises, so every rank stops with the same message and none is left
waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.tensor import DTensor

from meshtron.comm import CommGroup
from meshtron.config import ModelConfig
from meshtron.hf.checkpoint import (
    HFCheckpoint,
    parameter_sources,
    read_source,
)
from meshtron.hf.config import HEAD, checkpoint_config
from meshtron.parallel.engine import OwnedRows
from meshtron.parallel.expert import expert_parameter_names
from meshtron.parallel.parallelize import ParallelModel
from meshtron.parallel.tensor import TensorParallelPlan

TIED_WEIGHT = "tok_embeddings.weight"


@dataclass(frozen=True)
class LoadReport:
    """What one rank read of the checkpoint."""

    path: Path
    tensors: int  # checkpoint tensors it read from
    elements: int  # elements it read (each only once, except a tied head compared with the embedding)


def _local_rows(entry: OwnedRows) -> tuple[torch.Tensor, int, int, tuple[int, ...]]:
    """(the tensor this rank holds of `entry`, the index of its first row and its number of rows in the
    parameter as tensor and expert parallel left it, that parameter's shape)."""
    param = entry.param
    if isinstance(param, DTensor):  # fully_shard: the DTensor's placements say where its rows sit
        # DTensor's side of DCP's checkpoint protocol: the box of the logical tensor this rank holds.
        (box,) = param.__create_chunk_list__()
        return param.to_local(), box.offsets[0], box.sizes[0], tuple(param.shape)
    return param.data, entry.start, entry.rows, entry.shape


def logical_region(
    name: str,
    local_shape: tuple[int, ...],
    start: int,
    rows: int,
    plan: TensorParallelPlan | None,
    expert: tuple[int, int] | None,
) -> list[tuple[int, int]]:
    """The region of logical parameter `name` held in rows [start, start + rows) of this rank's
    `local_shape` tensor (cut by tensor parallel per `plan`, then by expert parallel when `expert` is
    (ep rank, ep size)), without the rows past the logical end (the padded vocabulary's)."""
    offsets, logical = [0] * len(local_shape), list(local_shape)
    ep_rank, ep = expert if expert is not None else (0, 1)
    offsets[0], logical[0] = ep_rank * local_shape[0], local_shape[0] * ep
    split = plan.split_dims.get(name) if plan is not None else None
    if split is not None:  # tensor parallel cut first: its blocks hold whole ep blocks along dim 0
        dim, size = split
        offsets[dim] += plan.tp.rank * local_shape[dim] * (ep if dim == 0 else 1)
        logical[dim] = size
    region = [(o, o + n) for o, n in zip(offsets, local_shape, strict=True)]
    first = offsets[0] + start
    region[0] = (min(first, logical[0]), min(first + rows, logical[0]))
    return region


def _read_owned(
    path: Path, parallel: ParallelModel, cfg: ModelConfig, ep: CommGroup, model_type: str
) -> tuple[LoadReport, list[str]]:
    """Read this rank's regions of every parameter it holds into its tensors; (report, problems)."""
    experts = expert_parameter_names(parallel.model) if ep.size > 1 else frozenset()
    problems = []
    with HFCheckpoint(path) as checkpoint:
        sources = parameter_sources(cfg, model_type, checkpoint)
        compare_head = cfg.tie_embeddings and HEAD in checkpoint.handles
        for entry in parallel.engine.owned_rows():
            target, start, rows, shape = _local_rows(entry)
            where = (ep.rank, ep.size) if entry.name in experts else None
            region = logical_region(entry.name, shape, start, rows, parallel.tp_plan, where)
            if any(stop <= first for first, stop in region):
                continue  # padding only
            values = read_source(checkpoint, sources[entry.name], region)
            if (
                entry.name == TIED_WEIGHT
                and compare_head
                and not torch.equal(values, checkpoint.read(HEAD, region))
            ):
                problems.append(
                    "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; set "
                    "tie_word_embeddings=false in config.json to train a separate output head"
                )
            target[: region[0][1] - region[0][0]].copy_(values.to(target.dtype))
        report = LoadReport(path, len(checkpoint.tensors_read), checkpoint.elements_read)
    return report, problems


@torch.no_grad()
def load_hf_weights(
    path: str | Path, parallel: ParallelModel, cfg: ModelConfig, ep: CommGroup, world: CommGroup
) -> LoadReport:
    """Collective over `world`: overwrite every parameter this rank holds (after `parallelize`) with its
    part of the checkpoint at `path`. Every rank raises the same ValueError if any rank found a problem."""
    path = Path(path)
    report, problems = LoadReport(path, 0, 0), []
    try:
        _, model_type = checkpoint_config(path)
        report, problems = _read_owned(path, parallel, cfg, ep, model_type)
    except (OSError, ValueError, SafetensorError) as err:  # said on every rank below, not only on its own
        problems = [str(err)]
    every = sorted({p for part in parallel.comm.all_gather_object(problems, world) for p in part})
    if every:
        raise ValueError(f"cannot initialise from {path}: " + " | ".join(every))
    parallel.engine.load_owned_rows()  # e.g. ZeRO-1/2: gather the whole parameters from the owned rows
    return report
