"""`meshtron train --dry-run`: what a run would be, printed instead of started.

Four parts, each from the code a real run (or `meshtron mesh` / `meshtron plan`) uses, so the dry run
cannot disagree with them:

  1. the resolved config (file, model preset, overrides), as TOML that loads back to the same Config
  2. the mesh (mesh.ParallelDims, dp_shard=-1 resolved), as `meshtron mesh` prints it
  3. the planner's prediction (plan/estimate.py) for exactly this layout on the hardware the run would
     use: the visible GPU mapped to the planner's table, or this machine's CPU (probe/hardware.py)
  4. the environment (observe/records.py), as the run would write it to run.dir/environment.json
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from meshtron.commands.memory_check import too_big
from meshtron.config.schema import Config
from meshtron.observe.records import config_text, environment, environment_text
from meshtron.plan.estimate import Cluster, estimate, exchange_choices, resolved_exchange, with_exchange
from meshtron.plan.gpu_memory import start_up_memory
from meshtron.plan.hardware import ACCELERATORS, accelerator, table_name
from meshtron.plan.layout import Layout
from meshtron.plan.muon import muon_bytes, newton_schulz_work
from meshtron.plan.report import TIME_PARTS
from meshtron.probe.cluster import ranks_per_node

GiB = 2**30
MiB = 2**20


def resolved(cfg: Config, world_size: int) -> Config:
    """`cfg` with dp_shard=-1 replaced by what the world leaves: the planner takes explicit degrees."""
    parallel = dataclasses.replace(cfg.parallel, dp_shard=cfg.parallel.dp_shard_for(world_size))
    return dataclasses.replace(cfg, parallel=parallel)


def layout_of(cfg: Config) -> Layout:
    """The planner's record of `cfg`'s layout (dp_shard resolved), printed in its `--layout` short form;
    only printed: the estimate takes `cfg` itself, since Layout.apply would reset pp_layers."""
    p, t = cfg.parallel, cfg.training
    return Layout(
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        vpp=p.vpp,
        ep=p.ep,
        etp=p.etp,
        ep_dispatch=p.ep_dispatch,
        dp_replicate=p.dp_replicate,
        dp_shard=p.dp_shard,
        zero=p.zero,
        micro_batch=t.micro_batch,
        recompute=t.recompute,
        pp_schedule=p.pp_schedule,
        cp_impl=p.cp_impl,
        sp=p.sp,
    )


class Hardware(NamedTuple):
    """What a run would train on: the planner's Cluster for it (None: no prediction), and in words."""

    cluster: Cluster | None
    says: str
    unit: str = "GPU"  # what one rank's device is called in the report


def _cuda_hardware(cfg: Config, world_size: int) -> Hardware:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = table_name(props.name, props.total_memory)
    if name is None:
        known = ", ".join(ACCELERATORS)
        return Hardware(None, f"GPU {props.name!r} is not in the planner's table ({known}); no prediction")
    if cfg.training.dtype == "fp32":  # the table holds tensor-core peaks; fp32 matmuls run far slower
        return Hardware(
            None,
            f"{props.name} is the planner's {name}, whose table has no fp32 matmul rate; "
            "add --training.dtype=bf16 for a prediction",
        )
    per_node = ranks_per_node(world_size)
    # What this device reports, not the table's nominal size: the driver keeps some for itself.
    gpu = dataclasses.replace(accelerator(name), memory_bytes=props.total_memory, gpus_per_node=per_node)
    peak = "fp8" if cfg.training.dtype == "fp8" else "bf16"  # (the planner's fp8 rate on every matmul)
    return Hardware(Cluster(gpu, world_size, peak), f"{props.name}, the planner's {name}")


def detect_hardware(cfg: Config, world_size: int) -> Hardware:
    """The hardware this run would train on, chosen as the trainer chooses it (run.device)."""
    import torch

    cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" and not cuda:
        return Hardware(None, "run.device='cuda' but no CUDA device is visible (the run would stop there)")
    if cfg.run.device == "cuda" or (cfg.run.device == "auto" and cuda):
        return _cuda_hardware(cfg, world_size)
    try:
        from meshtron.probe.hardware import cpu_cluster
    except ImportError:
        return Hardware(None, "this meshtron has no CPU probe (meshtron.probe.hardware); no prediction")
    return Hardware(cpu_cluster(world_size), "this machine's CPU, measured", "rank")


def _size(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


# Negative: ranks share the cores, and a stage idle in the bubble leaves its cores to the busy one.
LENT = "  (ranks share the cores: the other stages' idle time speeds this one up)"


def prediction_text(cfg: Config, cluster: Cluster, unit: str) -> str:
    """The planner's step time, throughput, MFU, memory by part and step by part for `cfg` (dp_shard
    resolved) on `cluster`; `unit` names one rank's device ("GPU", "rank")."""
    est = estimate(cfg, cluster)
    t = cfg.training
    limit = est.memory_limit_bytes
    verdict = "fits" if est.fits else "DOES NOT FIT: the run would go out of memory"
    lines = [
        f"step time          {est.step_time_s:.4g} s  ({t.global_batch} sequences x {t.seq_len} tokens)",
        f"tokens/s per {unit:<5} {est.tokens_per_sec_per_gpu:,.0f}",
        f"MFU                {100 * est.mfu:.1f}% of the {cluster.dtype} peak",
        f"memory per {unit:<7} {_size(est.memory_bytes_per_gpu)} of {_size(limit)} "
        f"({100 * est.memory_bytes_per_gpu / limit:.0f}%): {verdict}",
    ]
    lines += [f"  {part:<12} {_size(n):>12}" for part, n in est.memory.items()]
    first = start_up_memory(cfg, cluster.gpus, 0, cluster.memory)
    lines.append(
        f"  before step 1: {_size(sum(first.values()))} on the first stage (parameters "
        f"{_size(first['params'])}, gradient buffers {_size(first['grads'])}, reserved {_size(first['reserved'])})"
    )
    lines.append("step by part (the slowest stage; the parts add up to the step time):")
    order = [p for p in TIME_PARTS if p in est.time] + [p for p in est.time if p not in TIME_PARTS]
    for part in (p for p in order if est.time[p] != 0):  # a zero part is a dim this layout does not use
        s = est.time[part]
        why = LENT if part == "lent_cores" else ""
        lines.append(f"  {part:<12} {s:>10.4f} s {100 * s / est.step_time_s:>6.1f}%{why}")
    if cfg.parallel.pp > 1:
        # Over every stage (as `meshtron schedule` prints it), so it differs from the pp_bubble part above.
        lines.append(f"pipeline bubble    {100 * est.bubble_fraction:.1f}% of ranks x time")
    if len(exchange_choices(cfg)) > 1:
        times = {x: estimate(with_exchange(cfg, x), cluster).step_time_s for x in exchange_choices(cfg)}
        said = ", ".join(f"{x} {s:.4g} s" for x, s in times.items())
        lines.append(
            f"cp exchange        {resolved_exchange(cfg, cluster).parallel.cp_exchange} (step: {said})"
        )
    if t.optimizer == "muon":
        lines.append(_muon_line(cfg))
    if cfg.parallel.cp_impl == "hybrid":
        lines.append(
            "note: the planner times hybrid context parallel as a ring (its all-to-all is not modelled)"
        )
    return "\n".join(lines)


def _muon_line(cfg: Config) -> str:
    """Muon's work on the first stage's rank 0: Newton-Schulz FLOPs and the owners' exchange per step."""
    sent = sum(muon_bytes(cfg).values())
    return (
        f"muon               Newton-Schulz {newton_schulz_work(cfg) / 1e9:,.2f} GFLOP and the owners' "
        f"exchange {_size(sent)} sent per step; one fp32 momentum per matrix element (AdamW's: two)"
    )


def dry_run(cfg: Config, world_size: int, source: str) -> tuple[str, str | None]:
    """The whole report for a config already checked for `world_size` ranks, and why a real run would
    be refused for memory (commands/memory_check.py; None: it would start); `source` says where the
    config came from (file and overrides)."""
    text = config_text(cfg, world_size)
    env = environment(cfg, world_size)
    cfg = resolved(cfg, world_size)
    hardware = detect_hardware(cfg, world_size)
    cluster = hardware.cluster
    per_node = cluster.gpu.gpus_per_node if cluster else ranks_per_node(world_size)
    parts = [
        f"# resolved config: {source}",
        text,
        "",
        "# mesh",
        cfg.parallel.dims(world_size).describe(per_node, hardware.unit),
        "",
        f"# prediction for layout {layout_of(cfg).describe()}",
        f"hardware: {hardware.says}",
    ]
    if cluster is not None:
        parts.append(f"cluster: {cluster.describe()}")
        parts.append(prediction_text(cfg, cluster, hardware.unit))
    parts += ["", "# environment (as run.dir/environment.json will hold it)", environment_text(env)]
    refusal = too_big(cfg, world_size, cluster)  # against the hardware printed above
    verdict = "a real run would be refused (below)" if refusal else "the config is valid"
    parts += ["", f"dry run: {verdict}; nothing was started"]
    return "\n".join(parts), refusal
