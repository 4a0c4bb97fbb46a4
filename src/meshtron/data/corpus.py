"""Corpora: which files make one (text and source files, `.jsonl` with a "text" key, `.parquet` with a
"text" column) and their documents.

The default corpus is this interpreter's standard library source, which every Python install has.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from meshtron.data import DataError

PARQUET = ".parquet"
# Rows are read this many at a time, so a Parquet file of any size is read in bounded memory.
_PARQUET_BATCH_ROWS = 1024


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        return True
    if len(head) == 8192:
        # A multi-byte character cut at the read boundary must not make a text file look binary.
        head = head[:-3]
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def collect_files(inputs: Sequence[str | Path], exclude: Sequence[Path] = ()) -> list[Path]:
    """Expand ``inputs`` into files: files as given, directories recursively in sorted order.

    Inside directories, hidden entries (``.git`` ...) and binary-looking files (but Parquet) are skipped so
    that pointing at a source tree just works; a file named explicitly is always read (and fails loudly if
    not text)."""
    excluded = {p.resolve() for p in exclude}
    out: list[Path] = []
    for inp in inputs:
        p = Path(inp)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found: list[Path] = []
            for root, dirs, files in os.walk(p):
                rootp = Path(root)
                dirs[:] = [d for d in dirs if not d.startswith(".") and (rootp / d).resolve() not in excluded]
                for name in files:
                    fp = rootp / name
                    if name.startswith(".") or not fp.is_file():
                        continue
                    # Parquet is binary but a corpus format: kept where other binary files are skipped.
                    if fp.suffix == PARQUET or not _looks_binary(fp):
                        found.append(fp)
            # Sorting by relative path (not walk order) makes the corpus order filesystem-independent.
            found.sort(key=lambda f: f.relative_to(p).as_posix())
            out.extend(found)
        else:
            raise DataError(f"input {p} does not exist")
    parquet = [f for f in out if f.suffix == PARQUET]
    if parquet and importlib.util.find_spec("pyarrow") is None:  # said before any work starts
        raise DataError(
            f"{parquet[0]} is a Parquet file, and reading Parquet needs pyarrow, which is not installed: "
            "pip install 'meshtron[parquet]' (or pyarrow)"
        )
    return out


def _parquet_documents(path: Path) -> Iterator[tuple[Path, str]]:
    """One document per row of the file's "text" column (empty and null rows skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e})") from e
    schema = table.schema_arrow
    if "text" not in schema.names:
        raise DataError(f'{path}: expected a "text" column; it has {", ".join(schema.names) or "none"}')
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f'{path}: the "text" column must hold strings, it holds {kind}')
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text:
                yield path, text


def iter_documents(files: Iterable[Path]) -> Iterator[tuple[Path, str]]:
    """Yield ``(file, text)`` per document: one per text file, one per line of a ``.jsonl`` file, one per
    row of a ``.parquet`` file."""
    for path in files:
        if path.suffix == PARQUET:
            yield from _parquet_documents(path)
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8-sig") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{path}:{lineno}: invalid JSON ({e.msg}); fix or remove the line"
                        ) from e
                    if not isinstance(obj, dict) or "text" not in obj:
                        raise DataError(f'{path}:{lineno}: expected a JSON object with a "text" key')
                    if not isinstance(obj["text"], str):
                        raise DataError(
                            f'{path}:{lineno}: "text" must be a string, got {type(obj["text"]).__name__}'
                        )
                    if obj["text"]:
                        yield path, obj["text"]
        else:
            try:
                # utf-8-sig drops a BOM so it does not become a token at the start of the document.
                text = path.read_text(encoding="utf-8-sig")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text ({e}); convert it or leave it out") from e
            if text:
                yield path, text


def stdlib_files() -> list[Path]:
    """Top-level ``*.py`` of this interpreter's standard library, sorted by name (~170 files, ~4.7 MB)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in stdlib.glob("*.py") if p.is_file()), key=lambda p: p.name)
    if not files:
        raise DataError(f"no *.py files in the standard library dir {stdlib}; prepare your own data instead")
    return files
