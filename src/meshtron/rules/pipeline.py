"""What the pipeline needs of the layout: the layer split (schedules/split.py), the schedule (schedules/build.py), the
micro-batches per step, and DualPipeV's overlapped pairs (pipeline/pairs.py). Torch-free (checks.py gathers every
package's rules)."""

from __future__ import annotations

import os

from meshtron.config.schema import Config
from meshtron.rules.data import batch_problems, micro_batches_per_step
from meshtron.schedules.build import schedule_problems
from meshtron.schedules.split import split_problems


def pipeline_problems(cfg: Config, world_size: int, device_type: str | None = None) -> list[str]:
    """What the split and the schedule need of the layers and of the micro-batches per step
    (`device_type`: the job's, once it runs; before, run.device says what it can)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    chunks = p.pp * p.vpp
    problems = split_problems(m.n_layers, chunks, p.pp_layers, p.pp_embedding_layers, p.pp_head_layers)
    dp = p.dp_for(world_size)
    # Unknown when the batch does not split (the batch rule says so): its rules are left out then.
    microbatches = (
        None if batch_problems(cfg, world_size) else micro_batches_per_step(t.global_batch, t.micro_batch, dp)
    )
    problems += schedule_problems(p.pp, p.vpp, microbatches, p.pp_schedule)
    problems += pair_overlap_problems(cfg, world_size, device_type)
    if p.pp_balance == "cost" and (p.pp_layers or p.pp_embedding_layers or p.pp_head_layers):
        problems.append(
            "parallel.pp_balance='cost' weighs the embedding and the head by their FLOPs; drop "
            "parallel.pp_layers, pp_embedding_layers and pp_head_layers, or use pp_balance='layers'"
        )
    if p.pp > 1 and microbatches is not None and microbatches < p.pp:
        problems.append(
            f"{microbatches} micro-batch(es) per step cannot fill pp={p.pp} stages; raise "
            f"training.global_batch to at least {p.pp * t.micro_batch * dp}"
        )
    return problems


UNVERIFIED_PAIR_LANE = "MESHTRON_UNVERIFIED_PAIR_LANE"  # on CUDA: run the pair lane anyway


def pair_overlap_problems(cfg: Config, world_size: int, device_type: str | None = None) -> list[str]:
    """What `parallel.pp_overlap = true` needs of the layout."""
    p = cfg.parallel
    if not p.pp_overlap:
        return []
    if p.pp_schedule != "dualpipev" or p.pp == 1:
        return [
            "parallel.pp_overlap=true runs DualPipeV's F&B pairs at once: it needs parallel.pp > 1 with "
            "parallel.pp_schedule='dualpipev' (or set pp_overlap=false)"
        ]
    problems = []
    if p.zero == 3 and p.dp_shard_for(world_size) * p.cp > 1:
        problems.append(
            "parallel.pp_overlap=true cannot be combined with ZeRO-3 (a pair's forward and backward would "
            "gather and free parameter units from two threads): use parallel.zero=1 or 2, or pp_overlap=false"
        )
    device = device_type or ("cuda" if cfg.run.device == "cuda" else "cpu")
    if device != "cpu" and os.environ.get(UNVERIFIED_PAIR_LANE) != "1":
        problems.append(
            f"parallel.pp_overlap=true on {device} is built (the forward on its own stream, twin NCCL "
            "communicators) but not verified on two or more GPUs yet (docs/performance.md): set "
            f"{UNVERIFIED_PAIR_LANE}=1 to run it anyway, or parallel.pp_overlap=false"
        )
    if cfg.training.compile:
        problems.append(
            "parallel.pp_overlap=true cannot be combined with training.compile (compiled blocks are not run "
            "from two threads at once here): set one of them to false"
        )
    return problems
