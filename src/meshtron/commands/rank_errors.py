"""What a rank that a launcher of ours started leaves when it fails, and how the launcher reads it: each
failing rank writes its message to rank-R.txt in the folder MESHTRON_ERROR_DIR names (main.py), and the
launcher ends with the lowest rank's."""

from __future__ import annotations

from pathlib import Path

ERROR_DIR = "MESHTRON_ERROR_DIR"


def first_rank_error(errors: Path, err: Exception) -> str:
    """The message of the lowest rank that left one in `errors`, else what the launcher says."""
    files = sorted(errors.glob("rank-*.txt"), key=lambda f: int(f.stem.removeprefix("rank-")))
    if files:
        return f"rank {files[0].stem.removeprefix('rank-')}: {files[0].read_text().strip()}"
    return str(err).strip() or f"a rank exited abnormally ({type(err).__name__}); see its output above"
