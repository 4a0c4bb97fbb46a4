"""Optional Weights & Biases logging: with run.wandb_project set, rank 0 logs every step's scalars (the
ones TensorBoard gets) to a W&B run, created in run.dir with the resolved config and the environment.

wandb is an optional extra (`pip install 'meshtron[wandb]'`); a config that asks for it without the
package installed is refused at config time, with the other problems, before any process starts. W&B's
own environment variables apply as usual (WANDB_MODE=offline, WANDB_API_KEY, WANDB_ENTITY, ...).

A resumed run (a restart, or checkpoint.resume) continues the W&B run of the earlier attempt: its id is
kept in run.dir/wandb-run-id. W&B ignores rows for steps it already has, so the steps a crash made the
resumed run compute again keep the crashed attempt's values (the same losses: resume is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.config.schema import Config

RUN_ID_FILE = "wandb-run-id"


@dataclass
class WandbSettings:
    """What a W&B run is started with (on rank 0 only: the metrics logger starts it when enabled)."""

    project: str
    name: str
    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False  # continue the W&B run an earlier attempt in run_dir started

    @classmethod
    def of(cls, cfg: Config, environment: dict[str, Any] | None, resume: bool) -> WandbSettings | None:
        if not cfg.run.wandb_project:
            return None
        run_dir = Path(cfg.run.dir)
        return cls(
            project=cfg.run.wandb_project,
            name=cfg.run.wandb_name or run_dir.resolve().name,
            run_dir=run_dir,
            config={**cfg.to_dict(), "environment": environment or {}},
            resume=resume,
        )


def start_wandb(settings: WandbSettings) -> Any:
    """A started wandb Run; its id is saved so that a resumed attempt logs into the same run."""
    import wandb

    id_file = settings.run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if settings.resume and id_file.is_file() else None
    run = wandb.init(
        project=settings.project,
        name=settings.name,
        dir=str(settings.run_dir),
        config=settings.config,
        id=run_id,
        resume="allow" if run_id else None,
    )
    tmp = id_file.with_name(f".{RUN_ID_FILE}.tmp")
    tmp.write_text(f"{run.id}\n")
    tmp.replace(id_file)
    return run
