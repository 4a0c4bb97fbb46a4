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
the rows once, a block at a time, each block written straight into the tensor the region fills
(`init_region_`: no copy of the region is made). The single device and every parallel layout call the
same `init_region_`: a layout's shards are slices of the single-device tensors, bit for bit.
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


def _rows_into(out: torch.Tensor, name: str, seed: int, width: int, start: int, col0: int) -> None:
    """Rows [start, start + len(out)) of the [rows, width] view of `name`'s standard normal draws, their
    columns from `col0` (as many as `out` has), written into `out` a block at a time: one block is drawn
    at once and nothing is concatenated (no copy of the region besides `out` itself)."""
    per_block = max(1, BLOCK_ELEMENTS // width)
    stop, col1 = start + out.shape[0], col0 + out.shape[1]
    for block in range(start // per_block, (stop - 1) // per_block + 1):
        generator = torch.Generator().manual_seed(parameter_seed(seed, name, block))
        drawn = torch.randn(per_block, width, generator=generator)
        first, last = block * per_block, (block + 1) * per_block
        lo, hi = max(start, first), min(stop, last)
        out[lo - start : hi - start].copy_(drawn[lo - first : hi - first, col0:col1])


def init_region_(
    out: torch.Tensor, name: str, shape: Sequence[int], region: Region, cfg: ModelConfig, seed: int
) -> None:
    """Write parameter `name`'s initial values in `region` of its logical tensor of `shape` into `out` (of
    the region's shape): drawn straight into it when it is contiguous fp32 on the CPU, so that a rank
    initialising its shards makes no copy of them (the start-up peak); else (another dtype or device)
    through an fp32 copy on the CPU, converted once."""
    value = constant(name)
    if value is not None:
        out.fill_(value)
        return
    if out.numel() == 0:
        return
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        out.copy_(init_region(name, shape, region, cfg, seed))
        return
    width, lead = shape[-1], list(shape[:-1])
    *outer, (row0, row1), (col0, col1) = [(0, 1)] * (len(shape) < 2) + list(region)
    rows, n = out.view(-1, col1 - col0), row1 - row0  # one [n, columns] piece per outer index, in order
    for i, index in enumerate(itertools.product(*(range(a, b) for a, b in outer))):
        base = 0
        for j, size in zip(index, lead[:-1], strict=True):
            base = base * size + j
        base *= lead[-1] if lead else 1
        _rows_into(rows[i * n : (i + 1) * n], name, seed, width, base + row0, col0)
    out.mul_(init_std(name, cfg))  # in place: the same products as the whole tensor's, bit for bit


def init_region(name: str, shape: Sequence[int], region: Region, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Parameter `name`'s initial values (fp32) in `region` of its logical tensor of `shape`."""
    out = torch.empty([stop - start for start, stop in region])
    init_region_(out, name, shape, region, cfg, seed)
    return out


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter of a whole (single-device) model at its initial values."""
    for name, param in model.named_parameters():
        init_region_(param, name, param.shape, [(0, n) for n in param.shape], cfg, seed)
