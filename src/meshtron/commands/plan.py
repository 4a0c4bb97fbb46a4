"""`meshtron plan`: the layout for a model on a cluster, ranked by predicted step time (plan/search.py).
Torch-free, like the planner: it starts in a fraction of a second."""

from __future__ import annotations

import argparse
import sys

from meshtron.config.schema import ConfigError, refuse
from meshtron.rules.checks import config_notes, load_config


def _plan_inputs(args: argparse.Namespace, overrides: list[str]):
    """The model (config + --model.* flags), the cluster (--gpu, links) and the held layout keys."""
    import dataclasses

    from meshtron.plan.comm_time import Overlap
    from meshtron.plan.estimate import Cluster
    from meshtron.plan.hardware import accelerator, with_links
    from meshtron.plan.layout import parse_layout
    from meshtron.rules.model import model_problems, moe_problems

    # What the planner prices besides the layout keys: the model, the expert dispatcher, what per-op
    # recompute keeps.
    priced = ("--model.", "--parallel.ep_dispatch=", "--training.op_recompute_saves=",
              "--training.op_recompute_dispatch=")  # fmt: skip
    problems = [
        f"{o}: meshtron plan takes --model.KEY=VALUE overrides, --parallel.ep_dispatch=... and "
        "--training.op_recompute_saves=... / op_recompute_dispatch=... only"
        for o in overrides
        if not o.startswith(priced)
    ]
    if args.gpus < 1 or args.seq_len < 1 or args.global_batch < 1 or args.top < 1:
        problems.append("--gpus, --seq-len, --global-batch and --top must be positive")
    failures = args.failures_per_gpu_day
    if failures is not None and not (failures > 0 and args.storage_gbps > 0 and args.restart_s >= 0):
        problems.append("--failures-per-gpu-day and --storage-gbps must be positive, --restart-s at least 0")
    if not args.moe_imbalance >= 1.0:
        problems.append(f"--moe-imbalance={args.moe_imbalance}: max / mean expert load is at least 1")
    if args.dtype not in ("bf16", "fp8"):
        problems.append(f"--dtype={args.dtype} must be bf16 or fp8")
    try:
        overlap = Overlap.parse(args.overlap) if args.overlap is not None else None
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ConfigError(problems)
    cfg = load_config(args.config, overrides)
    if args.gpu.strip().lower() == "cpu":  # this machine, measured: ranks are processes on its cores
        from meshtron.probe.hardware import cpu_cluster

        cluster = cpu_cluster(args.gpus)
    else:
        cluster = Cluster(accelerator(args.gpu), args.gpus, args.dtype)
    gpu = with_links(cluster.gpu, args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node)
    cluster = dataclasses.replace(cluster, gpu=gpu, overlap=overlap or cluster.overlap)
    training = dataclasses.replace(
        cfg.training,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        dtype="fp32" if cluster.dtype == "fp32" else "bf16",
    )
    cfg = dataclasses.replace(cfg, training=training)
    refuse(model_problems(cfg.model) + moe_problems(cfg.model))
    return cfg, cluster, parse_layout(args.layout)


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshtron.plan.report import fits_nowhere, plan_json, plan_table
    from meshtron.plan.search import search

    cfg, cluster, fixed = _plan_inputs(args, overrides)
    for line in config_notes(args.config, overrides):  # which keys won over a preset
        print(f"meshtron: {line}", file=sys.stderr)
    plan = search(cfg, cluster, fixed, args.top, args.moe_imbalance)
    if args.json:
        print(plan_json(plan, cluster.overlap.names()))
    else:
        hidden = ",".join(cluster.overlap.names()) or "none"
        whose = (
            "given"
            if args.overlap is not None
            else "meshtron's on this CPU"
            if args.gpu.strip().lower() == "cpu"
            else "meshtron's"
        )
        print(
            f"{cfg.model.name or 'model'} on {cluster.describe()}, seq {cfg.training.seq_len}, "
            f"global batch {cfg.training.global_batch}; overlap: {hidden} ({whose})"
        )
        print(plan_table(plan, cluster.gpu.memory_bytes))
        if args.failures_per_gpu_day and plan.ranked:
            print("\n".join(_goodput(args, cfg, cluster, *plan.ranked[0])))
    if not plan.ranked:
        print(f"meshtron: {fits_nowhere(plan, cluster.gpu.memory_bytes)}", file=sys.stderr)
        return 1
    return 0


def _goodput(args: argparse.Namespace, cfg, cluster, layout, est) -> list[str]:  # noqa: ANN001
    """The best layout's goodput lines (plan/goodput.py): its step, its ranks' saved state, the links."""
    from meshtron.plan.goodput import FailureModel, goodput_lines
    from meshtron.plan.state import saved_bytes

    failures = FailureModel(
        failures_per_gpu_day=args.failures_per_gpu_day,
        gpus=cluster.gpus,
        step_s=est.step_time_s,
        state_bytes=saved_bytes(layout.apply(cfg), cluster.gpus),
        storage_bytes_per_s=args.storage_gbps * 1e9 / cluster.gpus,  # each GPU's share
        network_bytes_per_s=cluster.gpu.inter_node_bytes_per_s,
        restart_s=args.restart_s,
        replicas=layout.dp_replicate,
    )
    return [
        f"goodput of the first layout ({layout.describe()}):",
        *goodput_lines(failures, layout.dp_replicate),
    ]
