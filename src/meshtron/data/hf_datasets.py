"""Hugging Face `datasets` as prepare-data inputs (the optional `datasets` extra).

  input                          read as
  hf:NAME or hf:NAME:CONFIG      `load_dataset(NAME, CONFIG, split=..., streaming=True)`: from the hub,
                                 row by row as it downloads (where the network allows)
  a directory written by         `load_from_disk(DIR)`, the `--split` of a DatasetDict: memory-mapped
  `save_to_disk`                 Arrow, read in batches
  FILE.arrow                     `Dataset.from_file(FILE)`: one Arrow file, memory-mapped
  FILE.json                      `load_dataset("json", data_files=FILE, split="train")`: a JSON array or
                                 JSON lines, converted by datasets into its Arrow cache

Each row's `--text-field` (default "text") is one document. Rows are read a batch at a time, so memory
stays bounded whatever the dataset's size; empty texts are skipped, and a row whose field is missing or
not a string is refused with its index.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshtron.data import DataError

HUB_PREFIX = "hf:"
_BATCH = 1000


def is_dataset_input(spec: str | Path) -> bool:
    """Whether prepare-data reads `spec` through `datasets` (not as plain files)."""
    text = str(spec)
    if text.startswith(HUB_PREFIX):
        return True
    path = Path(text)
    return (
        path.suffix in (".arrow", ".json")
        and path.is_file()
        or (path / "state.json").is_file()
        or (path / "dataset_dict.json").is_file()
    )


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            'reading Hugging Face datasets needs the `datasets` package: pip install -e ".[datasets]"'
        ) from None
    return datasets


def _open(spec: str, split: str) -> Any:
    datasets = _datasets()
    if spec.startswith(HUB_PREFIX):
        name, _, config = spec[len(HUB_PREFIX) :].partition(":")
        try:
            return datasets.load_dataset(name, config or None, split=split, streaming=True)
        except Exception as err:  # offline, unknown name, no such split: datasets raises many kinds
            raise DataError(f"cannot load the hub dataset {name!r} (split {split!r}): {err}") from None
    path = Path(spec)
    if path.suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    if path.suffix == ".json":
        return datasets.load_dataset("json", data_files=str(path), split="train")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r} (it has {', '.join(loaded)}); pass --split")
        return loaded[split]
    return loaded


def dataset_documents(spec: str, split: str, text_field: str) -> Iterator[str]:
    """Every non-empty `text_field` of the dataset `spec` (the module docstring's table), in order."""
    data = _open(spec, split)
    columns = getattr(data, "column_names", None)
    if columns is not None and text_field not in columns:
        raise DataError(
            f"{spec} has no column {text_field!r} (it has {', '.join(columns)}); pass --text-field"
        )
    index = 0
    for batch in data.iter(batch_size=_BATCH):
        for text in batch.get(text_field, [None] * len(next(iter(batch.values())))):
            if not isinstance(text, str):
                raise DataError(
                    f"{spec}: row {index} has no string {text_field!r} (got {type(text).__name__})"
                )
            index += 1
            if text:
                yield text
