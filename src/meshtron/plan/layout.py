"""A layout: the parallel degrees and per-step choices the planner searches over, as a flat record.

`meshtron plan --layout "tp=8,pp=16,vpp=2,dp_shard=64,zero=1,micro_batch=1,recompute=selective"` fixes
some keys; the search fills the rest. A layout plus a model and a batch is a full meshtron Config
(`Layout.apply`), so the planner evaluates exactly what `meshtron train` would run, with the trainer's
own rules (checks.validate) deciding what is allowed.

  key            meaning (config field)                         searched over
  tp             tensor parallel (parallel.tp)                  1, 2, 4, ... up to the GPUs per node
  sp             sequence parallel with tp (parallel.sp)        on whenever tp > 1
  cp             context parallel (parallel.cp)                 powers of two while s/cp >= 4096
  cp_impl        ring, allgather, alltoall (parallel.cp_impl)   ring and alltoall
  pp             pipeline stages (parallel.pp)                  divisors of the GPUs left, <= layers
  vpp            chunks per stage (parallel.vpp)                2 and 4 with the interleaved schedule
  pp_schedule    gpipe, 1f1b, interleaved, zero_bubble          1f1b, interleaved, zero_bubble
  ep             expert parallel (parallel.ep; MoE only)        divisors of the experts that fold in
  etp            expert tensor parallel (parallel.etp)          tp (experts split) and 1 (whole experts,
                                                                ep over tp ranks too)
  ep_dispatch    alltoall, hierarchical, ... (parallel.        the config's; with it alltoall, also
                 ep_dispatch)                                   hierarchical where the ep group crosses
                                                                nodes (DeepEP's two hops)
  dp_replicate   replicas (parallel.dp_replicate)               1, or the groups of an HSDP shard
  dp_shard       sharded data parallel (parallel.dp_shard)      what the world size leaves
  zero           1, 2, 3 (parallel.zero)                        each
  micro_batch    sequences per micro-batch                      1, 2, 4, 8 (dividing the batch)
  recompute      none, op, selective, full                      each
  pp_head_layers the head + loss counted as this many layers     the head's FLOPs in layers (pp > 1),
                 in the balanced split (parallel.pp_head_layers) so the last stage is not the slowest
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_args

from meshtron.config.layout import ParallelDims
from meshtron.config.schema import (
    V_SCHEDULES,
    Config,
    ConfigError,
    CpImpl,
    EpDispatch,
    PipelineSchedule,
    Recompute,
)
from meshtron.utils.words import suggest

INT_KEYS = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp_replicate", "dp_shard", "zero", "micro_batch")
TEXT_KEYS = ("recompute", "pp_schedule", "cp_impl", "sp", "ep_dispatch")
FLOAT_KEYS = ("pp_head_layers",)
KEYS = INT_KEYS + TEXT_KEYS + FLOAT_KEYS
CHOICES: dict[str, tuple[str, ...]] = {
    "recompute": get_args(Recompute),
    "pp_schedule": get_args(PipelineSchedule),
    "cp_impl": get_args(CpImpl),
    "ep_dispatch": get_args(EpDispatch),
}


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelDims):
    """One candidate: the mesh's degrees (layout.ParallelDims, `dp_shard` resolved, never -1; world size,
    dp and groups come from there) and the per-step choices."""

    vpp: int = 1
    zero: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    cp_impl: str = "ring"
    ep_dispatch: str = ""  # "": the config's
    sp: bool = False
    pp_head_layers: float = 0.0

    def apply(self, cfg: Config) -> Config:
        """`cfg` with this layout's parallel degrees, micro-batch and recompute mode."""
        parallel = dataclasses.replace(
            cfg.parallel,
            tp=self.tp,
            sp=self.sp,
            cp=self.cp,
            cp_impl=self.cp_impl,
            pp=self.pp,
            vpp=self.vpp,
            pp_schedule=self.pp_schedule,
            pp_layers=[],
            pp_head_layers=self.pp_head_layers,
            ep=self.ep,
            etp=self.expert_tp,
            ep_dispatch=self.ep_dispatch or cfg.parallel.ep_dispatch,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            zero=self.zero,
        )
        training = dataclasses.replace(cfg.training, micro_batch=self.micro_batch, recompute=self.recompute)
        return dataclasses.replace(cfg, parallel=parallel, training=training)

    def describe(self) -> str:
        """The short form `--layout` takes (keys at their defaults left out, degrees always shown)."""
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.pp > 1:
            parts.append(f"pp_schedule={self.pp_schedule}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.pp_head_layers:
            parts.append(f"pp_head_layers={self.pp_head_layers:g}")
        if self.cp > 1:
            parts += [f"cp={self.cp}", f"cp_impl={self.cp_impl}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"etp={self.expert_tp}")
        if self.ep > 1 and self.ep_dispatch not in ("", "alltoall"):
            parts.append(f"ep_dispatch={self.ep_dispatch}")
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        parts += [
            f"dp_shard={self.dp_shard}",
            f"zero={self.zero}",
            f"micro_batch={self.micro_batch}",
            f"recompute={self.recompute}",
        ]
        return ",".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_layout(text: str) -> dict[str, Any]:
    """`"tp=8,pp=2,recompute=full"` -> {"tp": 8, "pp": 2, "recompute": "full"}; unknown keys and
    malformed values, and a choice that is not one of its key's, are refused (the fix named)."""
    fixed: dict[str, Any] = {}
    problems = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            problems.append(f"--layout item {item!r} must be KEY=VALUE")
        elif key not in KEYS:
            problems.append(
                f"--layout key {key!r} is not one of {', '.join(KEYS)}{suggest(key, KEYS, False)}"
            )
        elif key in INT_KEYS:
            if not value.isdigit() or int(value) < 1:
                problems.append(f"--layout {key}={value} must be a positive integer")
            else:
                fixed[key] = int(value)
        elif key in FLOAT_KEYS:
            try:
                fixed[key] = float(value)
            except ValueError:
                problems.append(f"--layout {key}={value} must be a number")
        elif key == "sp":
            if value.lower() not in ("true", "false"):
                problems.append(f"--layout sp={value} must be true or false")
            fixed[key] = value.lower() == "true"
        elif value not in CHOICES[key]:  # refused now, not after a search of every layout
            problems.append(
                f"--layout {key}={value} is not one of {', '.join(CHOICES[key])}{suggest(value, CHOICES[key], False)}"
            )
        else:
            fixed[key] = value
    if problems:
        raise ConfigError(problems)
    if fixed.get("pp_schedule") in V_SCHEDULES:  # a V holds two chunks per rank, as configs imply
        fixed.setdefault("vpp", 2)
    return fixed
