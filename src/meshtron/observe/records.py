"""What a run was: its fully resolved config and the environment it ran in.

Rank 0 writes both into `run.dir` when a run starts, before the data and the model are built, so that a
run which dies in start-up still says what it was:

  config.toml       every section and key, as TOML that loads back to the same Config (`meshtron train
                    --config run.dir/config.toml` reruns it); `meshtron train --dry-run` prints the same
  environment.json  meshtron / torch / Python versions, platform, host, device(s), world size, the mesh
                    (dims, each dim's group count and first group, the dims crossing nodes), the git commit
                    of the code, the command line, the restart attempt

Each start overwrites both (written atomically: a crash leaves the old file or the new one, never half of
one), so after a resume or a restart they describe the attempt that is running; `environment.json` says
which attempt that is and whether it was asked to resume. The history of the run is in metrics.jsonl and
the checkpoints, which a resume keeps.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import meshtron
from meshtron.config.schema import Config
from meshtron.utils.words import plural

CONFIG_FILE = "config.toml"
ENVIRONMENT_FILE = "environment.json"
# Set by `meshtron train --nproc` for the ranks it starts: their own argv is the launcher's rewrite.
COMMAND_ENV = "MESHTRON_COMMAND"
AUTO_LAYOUT_ENV = "MESHTRON_AUTO_LAYOUT"  # parallel.auto's choice (commands/auto_layout.py), as JSON


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a table in a list (asdict of [[data.sources]]): an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def config_text(cfg: Config, world_size: int) -> str:
    """Every section and key of `cfg`, as TOML: saved to a file, it reruns exactly this config (so
    dp_shard=-1 stays -1, with what it resolves to as a comment)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            line = f"{key} = {_toml_value(value)}"
            if (section, key, value) == ("parallel", "dp_shard", -1):
                line += f"  # {cfg.parallel.dp_shard_for(world_size)} on {plural(world_size, 'rank')}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines).rstrip()


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any] | None:
    """The commit of the checkout meshtron's code runs from, and whether it has uncommitted changes to
    tracked files; None for an installed copy or without git. Cached: the code does not change while a
    process runs, and parity workers start many runs."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _cpu_name() -> str:
    try:  # platform.processor() is often empty or just "x86_64" on Linux; cpuinfo names the model
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def devices(cfg: Config) -> dict[str, Any]:
    """The device(s) this node's ranks train on, chosen as the trainer chooses them (run.device)."""
    import torch

    cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" and not cuda:
        return {"type": "cuda", "error": "run.device='cuda' but no CUDA device is visible"}
    if cfg.run.device == "cuda" or (cfg.run.device == "auto" and cuda):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {
            "type": "cuda",
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "visible": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return {
        "type": "cpu",
        "name": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def mesh_record(cfg: Config, world_size: int, ranks_per_node: int) -> dict[str, Any]:
    """The mesh in a size that stays small on any cluster: the size of every dim; for each dim of size
    > 1 its number of groups and the first one (the others follow its pattern); the dims whose groups
    cross nodes."""
    dims = cfg.parallel.dims(world_size)
    table = dims.group_table()
    return {
        "summary": dims.summary(),
        "dims": {d: dims.size(d) for d in table},
        "groups": {d: {"count": len(g), "first": g[0]} for d, g in table.items() if len(g[0]) > 1},
        "crossing_nodes": dims.crossing_dims(ranks_per_node),
    }


def environment(cfg: Config, world_size: int) -> dict[str, Any]:
    """Where and how a run of `cfg` on `world_size` ranks runs (the fields of environment.json)."""
    import torch

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    command = os.environ.get(COMMAND_ENV) or shlex.join(sys.orig_argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return {
        "meshtron": meshtron.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "devices": devices(cfg),
        "world_size": world_size,
        "ranks_per_node": per_node,
        "nodes": -(-world_size // max(per_node, 1)),
        "mesh": mesh_record(cfg, world_size, max(per_node, 1)),
        "git": git_commit(),
        "command": command,
        "attempt": attempt,  # 0, or how many times the launcher restarted the ranks
        # Whether this attempt continues from the newest checkpoint (if any): asked, or after a restart.
        "resume": cfg.checkpoint.resume or attempt > 0,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **({"auto_layout": json.loads(os.environ[AUTO_LAYOUT_ENV])} if AUTO_LAYOUT_ENV in os.environ else {}),
    }


def environment_text(env: dict[str, Any]) -> str:
    """`env` for a console: one line per field, each value as compact JSON."""
    return "\n".join(f"{key}: {json.dumps(value)}" for key, value in env.items())


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_run_records(run_dir: str | Path, cfg: Config, world_size: int) -> dict[str, Any]:
    """Write config.toml and environment.json into `run_dir` (rank 0's job), replacing those of an earlier
    attempt; returns the environment."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = environment(cfg, world_size)
    _write_atomically(run_dir / CONFIG_FILE, config_text(cfg, world_size) + "\n")
    _write_atomically(run_dir / ENVIRONMENT_FILE, json.dumps(env, indent=2) + "\n")
    return env
