"""Initial weights, defined region by region, so that every rank can draw exactly the part it holds.

A parameter's initial values are a function of (seed, its logical name, its logical shape) only, never of
the layout, and any rectangular region of them can be drawn without the rest:

  norm weights    ones
  biases          zeros
  everything else normal(0, init_std), the residual-branch outputs (wo, w2, experts' w2) scaled by
                  1/sqrt(2 · n_layers) as in GPT-2

The normal draws view the tensor as rows of its last dim (leading dims flattened, row-major) in blocks of
about 2^16 elements (BLOCK_ELEMENTS // last dim rows): block b's values come from a generator seeded by
(seed, name, b). A region costs the blocks its rows touch, so a rank holding 1/n of a tensor's rows draws
about 1/n of it, and one holding a slice of every row (a row-parallel weight under tensor parallel) draws
the rows once, a block at a time. The single device and every parallel layout call the same `init_region`:
a layout's shards are slices of the single-device tensors, bit for bit.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence

import torch

from meshtron.config.schema import ModelConfig

BLOCK_ELEMENTS = 1 << 16
Region = Sequence[tuple[int, int]]  # (start, stop) per dim of the logical tensor


def parameter_seed(seed: int, name: str, block: int) -> int:
    """The seed of one block of a logical parameter's rows."""
    return (seed * 1_000_003 + zlib.crc32(f"{name}#{block}".encode())) % (2**63)


def init_std(name: str, cfg: ModelConfig) -> float:
    """The standard deviation of `name`'s normal draws."""
    owner = name.split(".")[-2] if "." in name else ""
    if owner in ("wo", "w2") or name.endswith("experts.w2"):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual-branch outputs, as in GPT-2
    return cfg.init_std


def constant(name: str) -> float | None:
    """1 for a norm's weight, 0 for a bias, None for a drawn parameter."""
    owner, leaf = (name.split(".")[-2] if "." in name else ""), name.split(".")[-1]
    if "norm" in owner:
        return 1.0
    return 0.0 if leaf == "bias" else None


def _rows(name: str, seed: int, width: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the [rows, width] view of `name`'s standard normal draws."""
    per_block = max(1, BLOCK_ELEMENTS // width)
    parts = []
    for block in range(start // per_block, (stop - 1) // per_block + 1):
        generator = torch.Generator().manual_seed(parameter_seed(seed, name, block))
        drawn = torch.randn(per_block, width, generator=generator)
        first, last = block * per_block, (block + 1) * per_block
        parts.append(drawn[max(start, first) - first : min(stop, last) - first])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def init_region(name: str, shape: Sequence[int], region: Region, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Parameter `name`'s initial values (fp32) in `region` of its logical tensor of `shape`."""
    out_shape = [stop - start for start, stop in region]
    value = constant(name)
    if value is not None:
        return torch.full(out_shape, value)
    if math.prod(out_shape) == 0:
        return torch.zeros(out_shape)
    width, lead = shape[-1], list(shape[:-1])
    *outer, (row0, row1), (col0, col1) = [(0, 1)] * (len(shape) < 2) + list(region)
    pieces = []
    for index in itertools.product(*(range(a, b) for a, b in outer)):
        base = 0
        for i, size in zip(index, lead[:-1], strict=True):
            base = base * size + i
        base *= lead[-1] if lead else 1
        pieces.append(_rows(name, seed, width, base + row0, base + row1)[:, col0:col1])
    return (torch.cat(pieces) * init_std(name, cfg)).reshape(out_shape)


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter of a whole (single-device) model at its initial values."""
    for name, param in model.named_parameters():
        param.copy_(init_region(name, param.shape, [(0, n) for n in param.shape], cfg, seed))
