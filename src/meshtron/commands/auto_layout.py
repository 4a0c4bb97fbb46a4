"""`meshtron train --parallel.auto=true`: the planner picks the layout, before any rank starts.

  1. the world: --nproc, or torchrun's WORLD_SIZE
  2. the hardware, as `--dry-run` detects it (commands/dry_run.py): the visible GPU mapped to the
     planner's table, or this machine's CPU measured by probe/hardware.py (under torchrun on a CPU, the
     measurement cached by an earlier `meshtron plan --gpu cpu` or `--nproc` run: every rank must read
     the same figures, and N ranks probing at once would measure each other)
  3. the keys the user set (in the config file or as overrides) are held; the planner's search
     (plan/search.py) fills every other layout key: tp, sp, cp, cp_impl, pp, vpp, pp_schedule, ep,
     dp_replicate, dp_shard, zero, micro_batch, recompute
  4. the fastest layout that fits and passes the trainer's rules is trained; the top three are
     printed with their predicted step time and memory, and why the winner won; config.toml records
     the chosen keys and environment.json the choice (`auto_layout`)

Nothing fits: refused before training, with what is short (as `meshtron plan` says it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.config.loading import load_toml, parse_override
from meshtron.config.schema import Config, ConfigError
from meshtron.observe.records import AUTO_LAYOUT_ENV
from meshtron.plan.estimate import Cluster, Estimate
from meshtron.plan.layout import Layout
from meshtron.plan.report import TIME_PARTS
from meshtron.plan.search import rank_key

GiB = 2**30
TRAINING_KEYS = ("micro_batch", "recompute")
# The Layout keys the search fills (pp_head_layers follows pp: the planner sets it with the split).
SEARCHED = ("tp", "sp", "cp", "cp_impl", "pp", "vpp", "pp_schedule", "ep", "etp", "ep_dispatch", "dp_replicate",
            "dp_shard", "zero", "micro_batch", "recompute")  # fmt: skip


@dataclass
class AutoChoice:
    """The chosen config, the top layouts with their estimates, and what was held."""

    cfg: Config
    ranked: list[tuple[Layout, Estimate]]
    held: dict[str, Any]
    hardware: str

    def record(self) -> dict[str, Any]:
        """What environment.json keeps of the choice."""
        return {
            "chosen": self.ranked[0][0].describe(),
            "held": self.held,
            "hardware": self.hardware,
            "top": [
                {
                    "layout": layout.describe(),
                    "step_time_s": est.step_time_s,
                    "memory_bytes": est.memory_bytes_per_gpu,
                }
                for layout, est in self.ranked
            ],
        }

    def text(self) -> str:
        """The top layouts and why the first won, for the console."""
        held = ", ".join(f"{k}={v}" for k, v in self.held.items()) or "nothing"
        lines = [f"parallel.auto: the planner's fastest layouts on {self.hardware} (held: {held})"]
        for i, (layout, est) in enumerate(self.ranked, 1):
            lines.append(
                f"  {i}. {est.step_time_s:.4g} s/step, {est.memory_bytes_per_gpu / GiB:.2f} GiB per rank  "
                f"{layout.describe()}"
            )
        lines.append(f"  chosen: 1. {why_first(self.ranked)}")
        return "\n".join(lines)

    def rank_flags(self) -> list[str]:
        """The chosen keys as overrides, for the ranks the launcher starts (auto off: they do not plan)."""
        layout = self.ranked[0][0].to_dict()
        flags = ["--parallel.auto=false"]
        for key in (*SEARCHED, "pp_head_layers"):
            section = "training" if key in TRAINING_KEYS else "parallel"
            value = str(layout[key]).lower() if isinstance(layout[key], bool) else layout[key]
            flags.append(f"--{section}.{key}={value}")
        return flags


def why_first(ranked: list[tuple[Layout, Estimate]]) -> str:
    """Why the first layout won (plan/search.py's rank_key): the part of the step where it gains most on
    the second, or the tie-break that chose it."""
    if len(ranked) == 1:
        return "the only layout that fits and passes the trainer's rules"
    first, second = ranked[0][1], ranked[1][1]
    if rank_key(ranked[0])[0] == rank_key(ranked[1])[0]:
        tie = f"as fast as 2. to 4 figures ({first.step_time_s:.4g} s)"
        if first.memory_bytes_per_gpu < second.memory_bytes_per_gpu:
            return (
                f"{tie}, with less memory: {first.memory_bytes_per_gpu / GiB:.3f} GiB against "
                f"{second.memory_bytes_per_gpu / GiB:.3f} GiB per rank"
            )
        if first.step_time_s < second.step_time_s:
            return f"{tie} and the same memory; unrounded, {first.step_time_s:.6g} s against {second.step_time_s:.6g} s"
        return f"{tie}, the same memory: the first of the two the search tried"
    gain = second.step_time_s / first.step_time_s - 1
    parts = [p for p in (*TIME_PARTS, "lent_cores") if p in first.time or p in second.time]
    part = max(parts, key=lambda p: second.time.get(p, 0.0) - first.time.get(p, 0.0))
    return (
        f"{100 * gain:.3g}% faster than 2., mostly in {part}: {first.time.get(part, 0.0):.4g} s against "
        f"{second.time.get(part, 0.0):.4g} s"
    )


def explicit_keys(path: str | Path | None, overrides: Sequence[str]) -> set[str]:
    """The `section.key`s a config file and its overrides set, rather than leave at their defaults."""
    raw = load_toml(path) if path is not None else {}
    keys = {
        f"{section}.{key}" for section, table in raw.items() if isinstance(table, Mapping) for key in table
    }
    return keys | {".".join(parse_override(text)[:2]) for text in overrides}


def held_keys(cfg: Config, explicit: set[str]) -> dict[str, Any]:
    """The layout keys the user set, with their values (dp_shard = -1 means "the rest": not held)."""
    held = {}
    for key in SEARCHED:
        section = "training" if key in TRAINING_KEYS else "parallel"
        if f"{section}.{key}" in explicit:
            held[key] = getattr(getattr(cfg, section), key)
    if held.get("dp_shard") == -1:
        del held["dp_shard"]
    if "parallel.pp_layers" in explicit and cfg.parallel.pp_layers:  # an explicit split fixes the stages
        held.setdefault("pp", len(cfg.parallel.pp_layers) // max(cfg.parallel.vpp, 1))
    return held


def _cluster(cfg: Config, world_size: int, under_launcher: bool) -> tuple[Cluster, str]:
    """The planner's cluster for this run's hardware, and its name; refused where there is none."""
    from meshtron.commands.dry_run import detect_hardware

    if under_launcher and not _uses_cuda(cfg):
        from meshtron.probe.hardware import DEMO, cache_key, cluster_from, launcher_threads, load_cached

        measured = load_cached(cache_key(world_size, launcher_threads(world_size), DEMO))
        if measured is None:
            raise ConfigError(
                [
                    f"parallel.auto under torchrun on a CPU needs this machine measured for {world_size} ranks "
                    f"first: run `meshtron plan --gpu cpu --gpus {world_size} ...` once (it caches), or start "
                    f"with `meshtron train --nproc {world_size}` instead of torchrun"
                ]
            )
        return cluster_from(measured), "this machine's CPU, measured (cached)"
    hardware = detect_hardware(cfg, world_size)
    if hardware.cluster is None:
        raise ConfigError([f"parallel.auto needs the planner's figures for this hardware: {hardware.says}"])
    return hardware.cluster, hardware.says


def _uses_cuda(cfg: Config) -> bool:
    import torch

    return cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())


def choose_layout(cfg: Config, world_size: int, explicit: set[str], under_launcher: bool) -> AutoChoice:
    """The planner's fastest layout of `cfg` on `world_size` ranks of this hardware, `explicit` keys held."""
    from meshtron.plan.report import fits_nowhere
    from meshtron.plan.search import search

    cluster, hardware = _cluster(cfg, world_size, under_launcher)
    held = held_keys(cfg, explicit)
    plan = search(cfg, cluster, held, top=3)
    if not plan.ranked:
        raise ConfigError(
            [f"parallel.auto on {world_size} ranks: {fits_nowhere(plan, cluster.gpu.memory_bytes)}"]
        )
    chosen = plan.ranked[0][0].apply(cfg)
    if "pp" in held and cfg.parallel.pp_layers:
        chosen = dataclasses.replace(
            chosen, parallel=dataclasses.replace(chosen.parallel, pp_layers=cfg.parallel.pp_layers)
        )
    chosen = dataclasses.replace(chosen, parallel=dataclasses.replace(chosen.parallel, auto=False))
    return AutoChoice(chosen, plan.ranked, held, hardware)


def announce(choice: AutoChoice) -> None:
    """Print the choice (once: on rank 0 under torchrun) and leave it for environment.json (this
    process's and the ranks')."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(choice.text(), flush=True)
    os.environ[AUTO_LAYOUT_ENV] = json.dumps(choice.record())
