"""A Hugging Face checkpoint written tensor by tensor: sharded safetensors files and their index.

`save_file` of the safetensors library writes a dict of tensors it holds all at once; a model larger than
a machine's memory cannot be written that way. Here the tensors are known by name, shape and dtype before
any is read (a meta-device model gives them), so each file's header is written first and then each
tensor's bytes as it is produced; only one meshtron parameter (e.g. one layer's stacked experts, written
as one tensor per expert) is in memory at a time. The files are what transformers writes:

  one file                  model.safetensors
  past max_shard_bytes      model-00001-of-0000N.safetensors ... and model.safetensors.index.json
                            ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}})

The safetensors format (an 8-byte little-endian header length, a JSON header of each tensor's dtype,
shape and [begin, end) byte offsets, then the raw row-major bytes) is checked against the library's own
reader in tests/test_export_generate.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, "5GB"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its name there, shape, and how to make it from the model's tensor
    `source` (index `part` along dim 0 of it, or all of it when part is None)."""

    name: str
    shape: tuple[int, ...]
    source: str
    part: int | None = None


def shards(entries: list[Entry], element_bytes: int, max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of at most max_shard_bytes each (a larger source alone), the entries of one
    source (e.g. a layer's experts) kept in one group, so that each source is read once."""
    by_source: list[list[Entry]] = []
    for entry in entries:
        if by_source and by_source[-1][0].source == entry.source:
            by_source[-1].append(entry)
        else:
            by_source.append([entry])
    groups: list[list[Entry]] = [[]]
    size = 0
    for same in by_source:
        nbytes = sum(_numel(e.shape) for e in same) * element_bytes
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1] += same
        size += nbytes
    return groups


def _numel(shape: Iterable[int]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _write_file(
    path: Path, entries: list[Entry], dtype: torch.dtype, read: Callable[[str], torch.Tensor]
) -> int:
    """One safetensors file: the header, then each entry's bytes, reading each source once (entries from
    the same source come together). Returns the bytes of tensor data written."""
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        nbytes = _numel(entry.shape) * element
        header[entry.name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        held: tuple[str, torch.Tensor] | None = None
        for entry in entries:
            if held is None or held[0] != entry.source:
                held = None  # the previous source's tensor goes before the next one is read
                held = (entry.source, read(entry.source).detach().to("cpu", dtype))
            tensor = held[1] if entry.part is None else held[1][entry.part]
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{entry.source} gives {entry.name} the shape {tuple(tensor.shape)}, not {entry.shape}"
                )
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)  # the bytes, not a copy of them
    return offset


def save_streamed(
    out: Path,
    entries: list[Entry],
    dtype: torch.dtype,
    read: Callable[[str], torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write `entries` (in this order; `read(source)` makes each source tensor when it is needed) under
    `out` as one safetensors file, or shards and an index past `max_shard_bytes`. Returns the files. If a
    tensor cannot be read or written, the files written so far are removed before the error goes on."""
    element = torch.empty((), dtype=dtype).element_size()
    groups = shards(entries, element, max_shard_bytes)
    if len(groups) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    written: list[Path] = []
    try:
        total = 0
        for name, group in zip(names, groups, strict=True):
            written.append(out / name)
            total += _write_file(out / name, group, dtype, read)
    except BaseException:  # a failed or interrupted export leaves no partial weights behind
        for path in written:
            path.unlink(missing_ok=True)
        raise
    if len(groups) > 1:
        weight_map = {e.name: name for name, group in zip(names, groups, strict=True) for e in group}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [out / name for name in names]
