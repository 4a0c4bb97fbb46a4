"""A Hugging Face checkpoint directory read tensor by tensor and slice by slice (for `model.init_from`).

`hf.load` reads every tensor into one process. A parallel run instead needs each rank to read only the
parts of the tensors it holds; this module knows the directory, and init_from.py the layout:

  HFCheckpoint        the safetensors files' headers (names, shapes), and `read(name, region)`, which
                      reads just that region through safetensors' `get_slice` (other rows, and other
                      tensors, are never read)
  checkpoint_config   the ModelConfig of config.json (config/huggingface.py's mapping), with the output head tied
                      when the checkpoint has no lm_head, as `hf.load` and transformers tie it
  parameter_sources   where each meshtron parameter's values lie in the checkpoint (weights.py's names; the
                      experts as one tensor per expert or fused), after checking that the checkpoint has
                      every tensor the model needs at its shape, and nothing else
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshtron.config.huggingface import HEAD, weight_files
from meshtron.config.schema import ModelConfig
from meshtron.hf.weights import (
    GLOBAL_RENAMES,
    IGNORED_KEY_PATTERN,
    MIXTRAL_EXPERT_NAMES,
    MTP_COPIES,
    QWEN_EXPERT_NAMES,
    block_location,
    layer_renames,
    mtp_layer,
    mtp_name,
)
from meshtron.models.llama import Transformer

Region = Sequence[tuple[int, int]]  # [start, stop) along every dim of a tensor


class HFCheckpoint:
    """The tensors of a checkpoint directory by name, read by region. Opening reads only the files'
    headers; `elements_read` counts what `read` has read since."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files = contextlib.ExitStack()
        self.handles: dict[str, Any] = {}
        try:
            for file in weight_files(self.path):
                handle = self._files.enter_context(safe_open(str(file), framework="pt"))
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    if name in self.handles:
                        raise ValueError(
                            f"tensor {name!r} appears in more than one shard (again in {file.name})"
                        )
                    self.handles[name] = handle
        except BaseException:
            self._files.close()
            raise
        self.elements_read = 0
        self.tensors_read: set[str] = set()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def names(self) -> set[str]:
        return set(self.handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name].get_slice(name).get_shape())

    def read(self, name: str, region: Region) -> torch.Tensor:
        """The `region` of tensor `name`: only its bytes are read from the file (a memory map)."""
        tensor = self.handles[name].get_slice(name)[tuple(slice(a, b) for a, b in region)]
        self.elements_read += tensor.numel()
        self.tensors_read.add(name)
        return tensor


@dataclass(frozen=True)
class Source:
    """Where one meshtron parameter lies in the checkpoint: in one tensor (`names[0]`; for w3 inside a
    fused gate_up_proj [E, 2F, D], from row `offset` = F of its dim 1 on), or, `stacked`, one tensor per
    expert along dim 0."""

    names: tuple[str, ...]
    stacked: bool = False
    offset: int = 0

    def expected_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape each of `names` must have for a parameter of `shape`."""
        if self.stacked:
            return shape[1:]
        if self.names[0].endswith("gate_up_proj"):
            return (shape[0], 2 * shape[1], *shape[2:])
        return shape


def _expert_source(names: set[str], layer: str, w: str, cfg: ModelConfig, model_type: str) -> Source:
    """experts.{w1,w3,w2}: from fused gate_up_proj / down_proj, or from one tensor per expert in either
    spelling (weights.py's `_load_experts` reads the same layouts)."""
    # transformers 5 names Mixtral's block `mlp` internally; checkpoints use `block_sparse_moe`.
    blocks = ("block_sparse_moe", "mlp") if model_type == "mixtral" else ("mlp",)
    for block in blocks:
        fused = f"{layer}{block}.experts.gate_up_proj"
        if fused in names:
            if w == "w2":
                return Source((f"{layer}{block}.experts.down_proj",))
            return Source((fused,), offset=0 if w == "w1" else cfg.expert_ffn_dim)
    styles = [(block, style) for block in blocks for style in (MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES)]
    default = (blocks[0], MIXTRAL_EXPERT_NAMES if model_type == "mixtral" else QWEN_EXPERT_NAMES)
    block, style = next(
        ((b, s) for b, s in styles if f"{layer}{b}.experts.0.{s[0][1]}.weight" in names), default
    )
    theirs = dict(style)[w]
    experts = tuple(f"{layer}{block}.experts.{j}.{theirs}.weight" for j in range(cfg.n_experts))
    return Source(experts, stacked=True)


def _source(name: str, names: set[str], cfg: ModelConfig, model_type: str) -> Source:
    location = block_location(name, cfg.n_layers)
    if location is None:
        return Source(
            (mtp_name(name, cfg.n_layers) if name.startswith("mtp.") else dict(GLOBAL_RENAMES)[name],)
        )
    layer, suffix = location
    if suffix.startswith("moe.experts."):
        return _expert_source(names, layer, suffix.rsplit(".", 1)[1], cfg, model_type)
    mixtral_block = model_type == "mixtral" and f"{layer}mlp.gate.weight" not in names
    renames = layer_renames(model_type, "block_sparse_moe" if mixtral_block else "mlp")
    return Source((layer + renames[suffix],))


def _mtp_not_read(name: str, cfg: ModelConfig) -> bool:
    """A tensor of an MTP module past model.mtp_depth, or a module's copy of the shared embedding or head."""
    index = mtp_layer(name, cfg.n_layers)
    return index is not None and (index >= cfg.mtp_depth or name.split(".", 3)[3] in MTP_COPIES)


def skipped_mtp_modules(names: set[str], cfg: ModelConfig) -> list[int]:
    """The checkpoint's MTP modules (layer numbers) a run with model.mtp_depth does not read."""
    return sorted(
        {
            cfg.n_layers + i
            for n in names
            if (i := mtp_layer(n, cfg.n_layers)) is not None and i >= cfg.mtp_depth
        }
    )


def _listed(names: Sequence[str], limit: int = 20) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def parameter_sources(cfg: ModelConfig, model_type: str, checkpoint: HFCheckpoint) -> dict[str, Source]:
    """Every meshtron parameter's (and router correction bias's) Source; ValueError naming every missing, unexpected or misshapen tensor
    (from the headers alone, so every rank finds the same problems)."""
    with torch.device("meta"):  # names and shapes only, no memory
        model = Transformer(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # The routers' correction biases are buffers, stored in checkpoints all the same.
    shapes |= {name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith("expert_bias")}
    names = checkpoint.names()
    sources = {name: _source(name, names, cfg, model_type) for name in shapes}
    missing, bad_shapes, used = [], [], set()
    for name, source in sources.items():
        want = source.expected_shape(shapes[name])
        for theirs in source.names:
            used.add(theirs)
            if theirs not in names:
                missing.append(theirs)
            elif checkpoint.shape(theirs) != want:
                bad_shapes.append(
                    f"{theirs}: checkpoint {list(checkpoint.shape(theirs))}, expected {list(want)}"
                )
    if cfg.tie_embeddings and HEAD in names:
        used.add(HEAD)  # a tied head must equal the embedding: the loader compares what it reads of both
    # MTP modules: their copies of the shared embedding and head are not read; modules past
    # model.mtp_depth are skipped (init_from.py says so).
    skipped = {n for n in names - used if _mtp_not_read(n, cfg)}
    unexpected = [n for n in names - used - skipped if not IGNORED_KEY_PATTERN.search(n)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listed(unexpected)}")
    if bad_shapes:
        problems.append(f"shape mismatches: {'; '.join(bad_shapes)}")
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint.path} does not fit a {model_type} model: " + " | ".join(problems)
        )
    return sources


def read_source(checkpoint: HFCheckpoint, source: Source, region: Region) -> torch.Tensor:
    """The `region` of a meshtron parameter (logical shape), read from where `source` says it lies."""
    if source.stacked:  # this region's experts, each read at the region's other dims
        (first, stop), rest = region[0], region[1:]
        return torch.stack([checkpoint.read(source.names[j], rest) for j in range(first, stop)])
    if source.offset:
        (a, b), shift = region[1], source.offset
        region = [region[0], (a + shift, b + shift), *region[2:]]
    return checkpoint.read(source.names[0], region)
