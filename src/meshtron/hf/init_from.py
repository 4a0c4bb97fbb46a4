"""`model.init_from = "DIR"`: a run starts from a Hugging Face checkpoint, in whatever layout it uses.

DIR is a directory as transformers writes it: config.json and model.safetensors, or safetensors shards
with model.safetensors.index.json (pickled weights are refused, as by `meshtron.hf.load`).

The config: config/init_from.py reads the architecture from DIR/config.json while the config is merged.

The weights (`load_hf_weights`, called by the Trainer after `parallelize`): each rank asks its
data-parallel engine which rows of which parameters it holds (`owned_rows`, as checkpoints do), turns
them into a region of the logical tensor and reads exactly that region from the safetensors file
(`get_slice`: a memory map, so the bytes of other rows and tensors are never read):

  pipeline       a stage's engine lists only its chunks' parameters; the other layers are never read
  tensor         a parameter split over tp (tp_plan.split_dims) is read at this tp rank's columns or
                 rows; the vocabulary's padding rows are left as they are (zeros); key/value heads
                 replicated because there are fewer than tp are read whole
  expert         ep rank e holds the e-th block of the experts (each split over tp with etp = tp; with
                 etp = 1 whole, the ep ranks taking tp ranks too): only those experts' tensors are read
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

from meshtron.comm.group import CommGroup
from meshtron.config.huggingface import HEAD, checkpoint_config
from meshtron.config.schema import ModelConfig
from meshtron.hf.checkpoint import (
    HFCheckpoint,
    parameter_sources,
    read_source,
    skipped_mtp_modules,
)
from meshtron.parallel.parallelize import ParallelModel
from meshtron.parallel.regions import Region, fill_owned_

TIED_WEIGHT = "tok_embeddings.weight"


@dataclass(frozen=True)
class LoadReport:
    """What one rank read of the checkpoint."""

    path: Path
    tensors: int  # checkpoint tensors it read from
    elements: int  # elements it read (each only once, except a tied head compared with the embedding)
    skipped_mtp: tuple[int, ...] = ()  # the layers of MTP modules past model.mtp_depth, not read


def _read_owned(
    path: Path, parallel: ParallelModel, cfg: ModelConfig, ep: CommGroup, model_type: str
) -> tuple[LoadReport, list[str]]:
    """Read this rank's regions of every parameter it holds into its tensors; (report, problems)."""
    problems = []
    with HFCheckpoint(path) as checkpoint:
        sources = parameter_sources(cfg, model_type, checkpoint)
        compare_head = cfg.tie_embeddings and HEAD in checkpoint.handles

        def read(name: str, _shape: tuple[int, ...], region: Region, out: torch.Tensor) -> None:
            values = read_source(checkpoint, sources[name], region)
            out.copy_(values)
            if (
                name == TIED_WEIGHT
                and compare_head
                and not torch.equal(values, checkpoint.read(HEAD, region))
            ):
                problems.append(
                    "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; set "
                    "tie_word_embeddings=false in config.json to train a separate output head"
                )

        fill_owned_(parallel, read, ep)
        for name, bias in parallel.model.named_buffers():  # whole on every rank that holds the router
            if name.endswith("expert_bias"):
                bias.copy_(read_source(checkpoint, sources[name], [(0, n) for n in bias.shape]))
        skipped = tuple(skipped_mtp_modules(checkpoint.names(), cfg))
        report = LoadReport(path, len(checkpoint.tensors_read), checkpoint.elements_read, skipped)
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
