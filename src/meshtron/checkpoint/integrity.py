"""Checkpoint integrity: a manifest of every file's size and SHA-256, written before a checkpoint is
published, checked before one is loaded; and the run's directories probed before training starts.

Hashing is shared out: each rank hashes the files whose index in the sorted listing is its rank modulo
the world size, and rank 0 writes `manifest.json` from what every rank found. A truncated, overwritten
or missing file is then reported by name, instead of surfacing as an unpickling or EOF error deep inside
torch.distributed.checkpoint, and resuming falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _my_files(directory: Path, world: CommGroup) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    return files[world.rank :: world.size]


def write_manifest(directory: Path, comm: Comm, world: CommGroup) -> None:
    """Collective: record every file of `directory` (a finished but unpublished checkpoint)."""
    mine = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _my_files(directory, world)}
    entries = {name: entry for part in comm.all_gather_object(mine, world) for name, entry in part.items()}
    if world.rank == 0:
        (directory / MANIFEST).write_text(json.dumps(entries, indent=1, sort_keys=True))


def corrupt_files(directory: Path, comm: Comm, world: CommGroup) -> list[str]:
    """Collective: what is wrong with `directory`'s files against its manifest ([] when intact, or for a
    checkpoint written before manifests existed)."""
    problems = file_problems(directory, world.rank, world.size)
    return sorted(p for part in comm.all_gather_object(problems, world) for p in part)


def file_problems(directory: Path, rank: int = 0, size: int = 1) -> list[str]:
    """What is wrong with this rank's share of `directory`'s files (every `size`-th listed in the
    manifest, from `rank`): with the defaults, all of them, checked by one process (export, generate)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return []
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        return [f"{MANIFEST} is unreadable ({err})"] if rank == 0 else []  # said once, not per rank
    names = sorted(manifest)
    problems = []
    for name in names[rank::size]:
        path, want = directory / name, manifest[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written")
        elif _sha256(path) != want["sha256"]:
            problems.append(f"{name} does not match its SHA-256")
    return problems


def unwritable(directory: Path, rank: int) -> str | None:
    """Why `directory` cannot take this run's files (None when it can): made if missing, then a probe
    file written and removed."""
    probe = directory / f".meshtron-write-probe-{rank}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"{directory} is not writable ({err.strerror or err})"
    return None
