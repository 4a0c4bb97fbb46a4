"""Corpora: which files make one (text and source files, `.jsonl` with a "text" key) and their documents.

The default corpus is this interpreter's standard library source, which every Python install has.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from meshtron.data import DataError


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

    Inside directories, hidden entries (``.git`` ...) and binary-looking files are skipped so that pointing
    at a source tree just works; a file named explicitly is always read (and fails loudly if not text).
    """
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
                    if not name.startswith(".") and fp.is_file() and not _looks_binary(fp):
                        found.append(fp)
            # Sorting by relative path (not walk order) makes the corpus order filesystem-independent.
            found.sort(key=lambda f: f.relative_to(p).as_posix())
            out.extend(found)
        else:
            raise DataError(f"input {p} does not exist")
    return out


def iter_documents(files: Iterable[Path]) -> Iterator[tuple[Path, str]]:
    """Yield ``(file, text)`` per document: one per text file, one per line of a ``.jsonl`` file."""
    for path in files:
        if path.suffix == ".jsonl":
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
