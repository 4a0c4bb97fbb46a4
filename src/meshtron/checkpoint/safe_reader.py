"""Reading a torch.distributed.checkpoint directory without running code stored in it.

DCP keeps tensors in its own files (read back with `torch.load(weights_only=True)`) but writes the
checkpoint's `.metadata` with pickle, and torch's FileSystemReader reads it with a plain `pickle.load`:
whoever can write a checkpoint directory could make every rank that loads it run arbitrary code.
`SafeFileSystemReader` reads `.metadata` with an unpickler that builds only what DCP metadata consists
of (its own metadata classes, torch sizes, dtypes and layouts, storage locations, paths) and refuses
anything else, naming it. Non-tensor values are the other pickle path (DCP's load planner reads them with
`weights_only=False`); save_load.py never writes any (the data sampler's integers are stored as tensors).

Its `read_data` reads only the box of each saved block that the load asks for (saved_regions.py), not
the whole block as torch's does: a rank resuming on another layout reads about its own share of the
checkpoint, and never holds more than its box of a block beyond what it keeps.

Private torch pieces, isolated here: `FileSystemReader._get_metadata_path` and `load_id`, because
`read_metadata` is torch's own with only the unpickler changed; the reader's `storage_data` (where each
saved item lies, which torch's `set_up_storage_reader` fills) and `transforms`, because `read_data` is
torch's own with the box read first.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from meshtron.checkpoint.saved_regions import read_box

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
    """FileSystemReader whose `.metadata` goes through the allow-list unpickler above, and that reads
    only the requested box of each saved tensor block (`tensor_bytes_read` counts those bytes)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.tensor_bytes_read = 0

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each requested tensor box read alone where its block allows (saved_regions.py), else its
        whole block through torch's reader; non-tensor items through torch's reader."""
        rest = []
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            box = None
            if item.type == LoadItemType.TENSOR and not stored.transform_descriptors:
                with self.fs.create_stream(self.fs.concat_path(self.path, stored.relative_path), "rb") as f:
                    box = read_box(f, stored.offset, stored.length, item.storage_offsets, item.lengths)
            if box is None:
                rest.append(item)
                continue
            tensor, nbytes = box
            self.tensor_bytes_read += nbytes
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise ValueError(
                    f"{item.storage_index}: box of size {tuple(tensor.size())} for {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)
