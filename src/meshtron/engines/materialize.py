"""Storage for parameters built on the meta device: each data-parallel engine asks for what a rank holds.

`parallelize` runs on a model whose parameters have shapes and no storage (models/llama.py's
`build_meta_model`): pipeline, tensor, context and expert parallel cut shapes, not values. The engine of
the data-parallel step then gives the parameters storage on the rank's device, as much as it keeps:
whole parameters for DDP and ZeRO-1/2 (replicas), nothing for ZeRO-3's module parameters (their gathered
units are allocated while they run; the engine's shards hold the values). Nothing is initialised here
(the storage is zeroed):
parallel/regions.py fills what each rank holds from the seeded initialisation or a checkpoint.

The Parameter objects stay the same (modules, tied weights and engines refer to them), their storage
swapped in with `torch.utils.swap_tensors`; the gradient hooks tensor parallel put on a parameter
(`grad_hooks`) no longer fire after the swap (the new tensor is not wired to the object's hook table), so
the table starts afresh and they are registered again.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch
from torch import nn


def is_meta(params: Iterable[nn.Parameter]) -> bool:
    return any(p.is_meta for p in params)


@torch.no_grad()
def materialize_(
    params: Iterable[nn.Parameter],
    device: torch.device,
    dtype: torch.dtype | None = None,
    empty: bool = False,
) -> None:
    """Give every meta parameter of `params` zeroed storage on `device` (in `dtype`, default its own): the
    rows no source fills (a padded vocabulary's) are zeros, never what the memory held; with `empty`,
    storage of size zero (an engine resizes it when it gathers the parameter)."""
    for p in params:
        if not p.is_meta:
            continue
        attributes = dict(p.__dict__)  # swapped away with the tensor: e.g. tensor parallel's grad_hooks
        # Empty storage is never zeroed: a full-size zeroed tensor per parameter touches every page, and
        # the allocator keeps the freed pages resident (hundreds of MB at start-up under ZeRO-3).
        make = torch.empty if empty else torch.zeros
        real = nn.Parameter(make(p.shape, dtype=dtype or p.dtype, device=device), p.requires_grad)
        if empty:
            real.untyped_storage().resize_(0)
        torch.utils.swap_tensors(p, real)
        p.__dict__.update(attributes)
        # The object keeps its hook table but the new tensor is not wired to it: start a fresh table.
        p._backward_hooks = None
        for hook in attributes.get("grad_hooks", []):
            p.register_hook(hook)


def untouched_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`numel` zeros that take no memory until written, on a CPU: an anonymous private mapping, whose
    pages the kernel zeroes as each is first written (reads of an unwritten page cost nothing).
    `torch.zeros` writes every page at once, so a buffer that stays zero until the first backward (a
    gradient shard) would be resident from start-up; elsewhere (a GPU) `torch.zeros`."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(numel, dtype=dtype, device=device)
    # The tensor keeps the mapping alive and unmaps it when it is freed. Private, so that no other process
    # (a forked one) shares it and reads are served from the zero page.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype)
