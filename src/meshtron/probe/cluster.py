"""This run's hardware in the planner's terms, read from the device and the host (nothing measured): what
the memory check refuses a layout against (commands/memory_check.py) and what cp_exchange = "auto"
(parallel/context_latent.py) is priced on. On a GPU its model from the planner's table (an H100's for
one the table lacks) with the memory the device reports; on a CPU its share of the host's RAM and
placeholder rates (a few cores' order of magnitude, which only order layouts); `meshtron plan --gpu cpu`
measures a CPU instead (probe/hardware.py)."""

from __future__ import annotations

import dataclasses
import os

from meshtron.config.schema import Config
from meshtron.plan.estimate import Cluster, exchange_choices, resolved_exchange, with_exchange
from meshtron.plan.gpu_memory import MemoryOverhead
from meshtron.plan.hardware import Accelerator, accelerator, table_name


def ranks_per_node(world_size: int) -> int:
    """The ranks on this host: meshtron's own launcher starts every rank here; torchrun says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def run_cluster(cfg: Config, world_size: int) -> Cluster | None:
    """What each rank of this run has, in the planner's terms, measured by nothing slow; None where the
    run would stop before allocating (run.device='cuda' without a GPU)."""
    import torch

    per_node = ranks_per_node(world_size)
    cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" or (cfg.run.device == "auto" and cuda):
        if not cuda:
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        base = accelerator(table_name(props.name, props.total_memory) or "h100")
        gpu = dataclasses.replace(base, memory_bytes=props.total_memory, gpus_per_node=per_node)
        return Cluster(gpu, world_size, "bf16")
    from meshtron.utils.resident import host_memory_bytes, resident_peak_bytes

    # Placeholder rates (a few cores' order of magnitude): they order the layouts listed, nothing else.
    cpu = Accelerator(
        name="cpu",
        bf16_flops_per_s=1e11,
        fp8_flops_per_s=None,
        fp32_flops_per_s=1e11,
        memory_bytes=host_memory_bytes() // per_node,
        hbm_bytes_per_s=1e10,
        intra_node_bytes_per_s=1e10,
        inter_node_bytes_per_s=1e10,
        gpus_per_node=per_node,
    )
    overhead = MemoryOverhead(context_bytes=float(resident_peak_bytes()), in_place_reduce=True)
    return Cluster(cpu, world_size, "fp32", memory=overhead)


def run_exchange(cfg: Config, world_size: int) -> Config:
    """`cfg` with parallel.cp_exchange = "auto" made the planner's choice for this run's hardware (the
    step it predicts the shorter), as training takes it; unchanged where nothing is to choose."""
    if cfg.parallel.cp_exchange != "auto" or len(exchange_choices(cfg)) == 1:
        return cfg  # (nothing to choose: "auto" runs the keys and values, as "kv" does)
    cluster = run_cluster(cfg, world_size)
    dims = dataclasses.replace(cfg.parallel, dp_shard=cfg.parallel.dp_shard_for(world_size))
    chosen = resolved_exchange(dataclasses.replace(cfg, parallel=dims), cluster) if cluster else None
    return with_exchange(cfg, chosen.parallel.cp_exchange if chosen is not None else "kv")
