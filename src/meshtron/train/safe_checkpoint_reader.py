"""Reading a torch.distributed.checkpoint directory without running code stored in it.

DCP keeps tensors in its own files (read back with `torch.load(weights_only=True)`) but writes the
checkpoint's `.metadata` with pickle, and torch's FileSystemReader reads it with a plain `pickle.load`:
whoever can write a checkpoint directory could make every rank that loads it run arbitrary code.
`SafeFileSystemReader` reads `.metadata` with an unpickler that builds only what DCP metadata consists
of (its own metadata classes, torch sizes, dtypes and layouts, storage locations, paths) and refuses
anything else, naming it. Non-tensor values are the other pickle path (DCP's load planner reads them with
`weights_only=False`); checkpoint.py never writes any (the data sampler's integers are stored as tensors).

Private torch pieces, isolated here: `FileSystemReader._get_metadata_path` and `load_id`, because this
method is torch's own `read_metadata` with only the unpickler changed.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks up one of torch's layouts by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's metadata names {module}.{name}, which DCP metadata never holds; refusing to "
            "load it (it could run code)"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through the allow-list unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"the checkpoint's metadata is a {type(metadata).__name__}, not DCP's"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
