"""Reading a box of a tensor that torch.save wrote, without reading the rest of it.

A DCP checkpoint file holds one torch.save archive per saved block: an uncompressed zip of the pickled
tensor description (`data.pkl`), the storage's raw bytes (`data/<key>`) and their byte order. A load
on another layout asks for a box of such a block (this rank's rows of another rank's block); torch's
FileSystemReader loads the whole block and cuts the box out, so a rank reads, and holds for a moment,
every block its box touches. Here only the box's rows are read:

  step                   how
  the archive            the block's (offset, length) in its file, from DCP's metadata
  its description        data.pkl through an unpickler that builds a tensor's layout (storage key,
                         dtype, offset, size, stride) and nothing else
  where the bytes are    the zip directory's entry for data/<key> and its local header
  the box                rows [r0, r1) of a contiguous tensor are one byte range: read it, view it,
                         narrow the other dims to the box

Anything else (a non-contiguous tensor, a compressed entry, another byte order, a 0-d tensor, an
unknown pickle) returns None, and the caller reads the whole block as torch does.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import IO, Any

import torch


@dataclass(frozen=True)
class _Layout:
    key: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.size):
            expected.append(step)
            step *= n
        return tuple(reversed(expected)) == self.stride


def _layout(storage: tuple[str, torch.dtype], offset: int, size: Any, stride: Any, *_: Any) -> _Layout:
    return _Layout(storage[0], storage[1], offset, tuple(size), tuple(stride))


# The typed-storage names torch.save writes (for compatibility) and the dtypes they stand for.
_STORAGE_DTYPES = {
    f"{name}Storage": dtype
    for name, dtype in [("Float", torch.float32), ("Double", torch.float64), ("Half", torch.float16),
                        ("BFloat16", torch.bfloat16), ("Long", torch.int64), ("Int", torch.int32),
                        ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8), ("Bool", torch.bool)]
}  # fmt: skip


class _LayoutUnpickler(pickle.Unpickler):
    """torch.save's pickle of one tensor, built as its layout: a storage becomes (key, dtype)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype]:
        _kind, dtype, key, _location, _numel = pid
        return key, dtype


class _Slice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own."""

    def __init__(self, file: IO[bytes], start: int, length: int):
        self.file, self.start, self.length, self.pos = file, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.file.seek(self.start + self.pos)
        data = self.file.read(n)
        self.pos += len(data)
        return data


def _describe(archive: zipfile.ZipFile) -> tuple[_Layout, zipfile.ZipInfo] | None:
    prefix = archive.namelist()[0].split("/")[0]
    try:
        if archive.read(f"{prefix}/byteorder").decode() != sys.byteorder:
            return None
        layout = _LayoutUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
        info = archive.getinfo(f"{prefix}/data/{layout.key}")
    except (KeyError, pickle.UnpicklingError, AttributeError, ValueError, TypeError):
        return None
    if not isinstance(layout, _Layout) or not layout.size or not layout.contiguous():
        return None
    return (layout, info) if info.compress_type == zipfile.ZIP_STORED else None


def read_box(
    file: IO[bytes], start: int, length: int, offsets: torch.Size, lengths: torch.Size
) -> tuple[torch.Tensor, int] | None:
    """The box (`offsets`, `lengths`) of the tensor torch.save wrote at [start, start + length) of
    `file`, and the bytes of it read; None where the whole archive must be loaded instead."""
    view = _Slice(file, start, length)
    try:
        with zipfile.ZipFile(view) as archive:
            found = _describe(archive)
    except zipfile.BadZipFile:
        return None
    if found is None:
        return None
    layout, info = found
    view.seek(info.header_offset)
    name_length, extra_length = struct.unpack("<HH", view.read(30)[26:30])
    data_start = info.header_offset + 30 + name_length + extra_length
    row = math.prod(layout.size[1:])
    first, rows = offsets[0], lengths[0]
    view.seek(data_start + (layout.offset + first * row) * layout.dtype.itemsize)
    data = bytearray(view.read(rows * row * layout.dtype.itemsize))
    box = torch.frombuffer(data, dtype=layout.dtype).view(rows, *layout.size[1:])
    for dim in range(1, len(layout.size)):
        box = box.narrow(dim, offsets[dim], lengths[dim])
    return box, len(data)
