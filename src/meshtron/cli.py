"""`meshtron` command line: train, verify, plan, mesh, schedule, context, prepare-data, export, generate."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from meshtron.config import ConfigError, PipelineSchedule, check, load_config, refuse
from meshtron.data import DataError
from meshtron.train.checkpoint import CheckpointError
from meshtron.train.nonfinite import TrainingDiverged


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


LAUNCHER_FLAGS = ("--nproc", "--max-restarts")


def _launch(nproc: int, max_restarts: int, argv: Sequence[str]) -> int:
    """Start `nproc` local ranks of `meshtron train` through torch's elastic launcher (what torchrun runs);
    when a rank dies, the launcher restarts them all up to `max_restarts` times, and they resume from the
    newest complete checkpoint (Trainer.resume_if_asked)."""
    from torch.distributed.run import get_args_parser, run

    # Drop the launcher's own flags (as "--flag=N" or "--flag N") so the ranks do not launch again.
    cleaned: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in LAUNCHER_FLAGS:
            skip = True
            continue
        if arg.split("=", 1)[0] in LAUNCHER_FLAGS:
            continue
        cleaned.append(arg)
    launcher_args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            "--module",
            "meshtron.cli",
            *cleaned,
        ]
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The ranks' own argv is the launcher's rewrite; environment.json records what the user typed.
    os.environ["MESHTRON_COMMAND"] = shlex.join(["meshtron", *argv])
    try:
        run(launcher_args)
    except Exception as err:  # the launcher raises ChildFailedError with each rank's exit status
        print(f"meshtron: training failed on one or more ranks: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: Sequence[str]) -> int:
    cfg = load_config(args.config, overrides)
    world_size = args.nproc or int(os.environ.get("WORLD_SIZE", 1))
    check(cfg, world_size)  # every problem reported before any process starts
    if args.dry_run:  # after check: a layout a real run refuses is refused here the same way
        from meshtron.dry_run import dry_run

        print(dry_run(cfg, world_size, " ".join([args.config, *overrides])))
        return 0
    if args.nproc and args.nproc > 1 and not _under_launcher():
        return _launch(args.nproc, args.max_restarts, argv)
    from meshtron.train.trainer import train

    train(cfg)
    return 0


def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    check(cfg, args.nproc)  # the layout as given must be valid before it is shrunk
    from meshtron.verify import verify

    return verify(cfg, args.nproc, args.steps, args.tolerance)


def cmd_mesh(args: argparse.Namespace) -> int:
    from meshtron.mesh import ParallelDims, draw_mesh

    try:
        dims = ParallelDims(
            pp=args.pp,
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            cp=args.cp,
            tp=args.tp,
            ep=args.ep,
            cp_ulysses=args.cp_ulysses,
        )
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    if args.gpus_per_node < 1:
        raise ConfigError([f"--gpus-per-node={args.gpus_per_node} must be positive"])
    print(dims.to_json() if args.json else dims.describe(args.gpus_per_node))
    if args.out:
        path = draw_mesh(dims, args.gpus_per_node, args.out)
        if not args.json:
            print(f"picture written to {path}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from meshtron.pipeline.schedules import SPLIT_BACKWARD, V_SCHEDULES, build_schedule, simulate

    if args.vpp is None:  # chunks per rank: two for a V schedule, else one
        args.vpp = 2 if args.schedule in V_SCHEDULES else 1
    try:
        if args.paired and args.schedule != "dualpipev":
            raise ValueError("--paired is DualPipeV's: use it with --schedule dualpipev")
        schedule = build_schedule(args.pp, args.vpp, args.microbatches, args.schedule, args.paired)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    split = args.schedule in SPLIT_BACKWARD
    sim = simulate(schedule, 1.0, 2.0, 1.0 if split else 0.0, vpp=args.vpp)
    print(
        f"{args.schedule}: pp={args.pp} vpp={args.vpp} micro-batches={args.microbatches}; costs forward 1, "
        f"backward 2" + (" (input grad 1 + weight grad 1)" if split else "")
    )
    print(f"step time {sim.makespan:g}, bubble {100 * sim.bubble_fraction:.1f}% of ranks x time")
    print("peak micro-batches in flight per rank: " + ", ".join(map(str, sim.peak_in_flight)))
    for rank, actions in enumerate(schedule):
        print(f"rank {rank}: " + " ".join(str(a) for a in actions if a.kind.is_compute))
    if args.paired:
        print("F...& is the forward of an F&B pair: it runs at once with the B and W after it")
    if args.out:
        from meshtron.pipeline.picture import draw_timeline

        title = (
            f"{args.schedule}, pp={args.pp}, vpp={args.vpp}, {args.microbatches} micro-batches: "
            f"bubble {100 * sim.bubble_fraction:.1f}%"
        )
        print(f"picture written to {draw_timeline(sim.timeline, args.out, title, args.vpp)}")
    return 0


def cmd_context(args: argparse.Namespace) -> int:
    from meshtron.parallel.context_picture import draw_assignment, ring_steps_table, ring_work

    if args.ring < 1:
        raise ConfigError([f"--ring={args.ring} must be positive"])
    print(ring_steps_table(args.ring))
    for zigzag in (True, False):
        work = ", ".join(f"{w:g}" for w in ring_work(args.ring, zigzag))
        print(f"attention work per rank ({'zigzag' if zigzag else 'contiguous'} chunks): {work}")
    if args.out:
        print(f"picture written to {draw_assignment(args.ring, args.out)}")
    return 0


def _plan_inputs(args: argparse.Namespace, overrides: list[str]):
    """The model (config + --model.* flags), the cluster (--gpu, links) and the held layout keys."""
    import dataclasses

    from meshtron.models.llama import model_problems
    from meshtron.models.moe import moe_problems
    from meshtron.plan.estimate import Cluster
    from meshtron.plan.hardware import accelerator, with_links
    from meshtron.plan.layout import parse_layout

    problems = [
        f"{o}: meshtron plan takes --model.KEY=VALUE overrides only"
        for o in overrides
        if not o.startswith("--model.")
    ]
    if args.gpus < 1 or args.seq_len < 1 or args.global_batch < 1 or args.top < 1:
        problems.append("--gpus, --seq-len, --global-batch and --top must be positive")
    if not args.moe_imbalance >= 1.0:
        problems.append(f"--moe-imbalance={args.moe_imbalance}: max / mean expert load is at least 1")
    if args.dtype not in ("bf16", "fp8"):
        problems.append(f"--dtype={args.dtype} must be bf16 or fp8")
    if problems:
        raise ConfigError(problems)
    cfg = load_config(args.config, overrides)
    if args.gpu.strip().lower() == "cpu":  # this machine, measured: ranks are processes on its cores
        from meshtron.hardware_probe import cpu_cluster

        cluster = cpu_cluster(args.gpus)
    else:
        cluster = Cluster(accelerator(args.gpu), args.gpus, args.dtype)
    gpu = with_links(cluster.gpu, args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node)
    cluster = dataclasses.replace(cluster, gpu=gpu)
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
    plan = search(cfg, cluster, fixed, args.top, args.moe_imbalance)
    if args.json:
        print(plan_json(plan))
    else:
        print(
            f"{cfg.model.name or 'model'} on {cluster.describe()}, seq {cfg.training.seq_len}, "
            f"global batch {cfg.training.global_batch}"
        )
        print(plan_table(plan, cluster.gpu.memory_bytes))
    if not plan.ranked:
        print(f"meshtron: {fits_nowhere(plan, cluster.gpu.memory_bytes)}", file=sys.stderr)
        return 1
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    import time

    from meshtron.data.dataset import prepare_data

    start = time.perf_counter()
    # Progress on stderr when it is a terminal; in a log, the line below is all prepare-data prints.
    data = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    seconds = time.perf_counter() - start
    print(
        f"wrote {data.n_tokens:,} tokens ({data.tokens.dtype}, vocab {data.vocab_size}, "
        f"{data.n_documents} documents from {len(data.sources)} files) to {Path(args.out)} in "
        f"{seconds:.1f} s ({data.n_tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from meshtron.export import export

    print(export(args.checkpoint, args.out, args.config, getattr(torch, args.dtype)))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from meshtron.export import model_for_generation
    from meshtron.models.generate import complete

    if args.max_new_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(["--max-new-tokens and --temperature must be >= 0, --top-p in (0, 1]"])
    model, tok = model_for_generation(args.checkpoint, args.hf, args.config, args.device)
    text = complete(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    print(args.prompt + text)
    return 0


def _add_checkpoint_parsers(sub: argparse._SubParsersAction) -> None:
    where = "a checkpoint (step-NNNNNNNN), or a checkpoints or run directory: its newest complete one"
    config = "the run's config file, for a checkpoint that carries none (older than this option)"
    export = sub.add_parser(
        "export",
        help="write a training checkpoint (any layout) as a Hugging Face directory (+ tokenizer)",
        epilog="example: meshtron export --checkpoint runs/demo/checkpoints --out runs/demo/hf",
    )
    export.add_argument("--checkpoint", required=True, help=where)
    export.add_argument(
        "--out", required=True, help="directory for config.json, model.safetensors, tokenizer"
    )
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    export.add_argument("--config", help=config)
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a trained model on one device (KV cache)",
        epilog='example: meshtron generate --checkpoint runs/demo/checkpoints --prompt "def " --temperature 0',
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help=where)
    source.add_argument("--hf", help="a Hugging Face model directory (config.json, safetensors, tokenizer)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep this much probability")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    gen.add_argument("--config", help=config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtron", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model; extra --section.key=value flags override the config",
        epilog="example: meshtron train --config configs/demo.toml --training.steps=50",
    )
    train.add_argument("--config", required=True, help="TOML config file (see configs/)")
    train.add_argument(
        "--nproc", type=int, default=0, help="launch this many local ranks (gloo on CPU, NCCL on GPU)"
    )
    verify = sub.add_parser(
        "verify",
        help="before a big job: run its layout and one device on a shrunk copy of the model and compare",
        epilog="example: meshtron verify --config configs/mixtral-8x7b.toml --nproc 8 --parallel.tp=2 "
        "--parallel.dp_shard=4 --parallel.ep=4",
    )
    verify.add_argument("--config", required=True, help="TOML config file (see configs/)")
    verify.add_argument("--nproc", type=int, required=True, help="local ranks to run the layout on")
    verify.add_argument("--steps", type=int, default=5, help="steps of each run (default 5)")
    verify.add_argument("--tolerance", type=float, default=1e-5, help="relative loss / gradient tolerance")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: restart every rank up to this many times when one dies; they resume from the "
        "newest complete checkpoint (set checkpoint.every)",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, print it resolved, the mesh and the planner's prediction on this hardware, "
        "and exit without starting anything",
    )

    _add_picture_parsers(sub)
    _add_plan_parser(sub)
    _add_checkpoint_parsers(sub)
    prep = sub.add_parser("prepare-data", help="tokenize text / jsonl files into a token memmap")
    prep.add_argument(
        "inputs",
        nargs="+",
        help="files or directories (.txt, .py, .md, .jsonl with a 'text' key, .parquet with a 'text' column)",
    )
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte', 'bpe' (trained on the inputs) or a path to a tokenizer.json",
    )
    prep.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size when training a BPE")
    return parser


def _add_picture_parsers(sub: argparse._SubParsersAction) -> None:
    """`mesh`, `schedule` and `context`: print and draw a layout, a pipeline schedule, a ring."""
    mesh = sub.add_parser("mesh", help="print and draw the rank layout of a parallel configuration")
    for dim in ("pp", "dp-replicate", "dp-shard", "cp", "tp", "ep"):
        mesh.add_argument(f"--{dim}", type=int, default=1)
    mesh.add_argument(
        "--cp-ulysses",
        type=int,
        default=1,
        help="hybrid context parallel: all-to-all ranks in each ring rank",
    )
    mesh.add_argument("--gpus-per-node", type=int, default=8)
    mesh.add_argument("--json", action="store_true", help="print dims and groups as JSON")
    mesh.add_argument("--out", help="write a PNG picture of the mesh here")

    sched = sub.add_parser("schedule", help="simulate and draw a pipeline schedule")
    sched.add_argument("--pp", type=int, required=True)
    sched.add_argument(
        "--vpp", type=int, default=None, help="chunks per rank (default: 2 for zbv and dualpipev, else 1)"
    )
    sched.add_argument("--microbatches", type=int, required=True)
    sched.add_argument("--schedule", default="1f1b", help=", ".join(typing.get_args(PipelineSchedule)))
    sched.add_argument("--out", help="write a PNG of the timeline here")
    sched.add_argument(
        "--paired",
        action="store_true",
        help="dualpipev: its F&B pairs as units (both receives first), as parallel.pp_overlap runs them",
    )

    ctx = sub.add_parser("context", help="print and draw how ring attention splits causal attention")
    ctx.add_argument("--ring", type=int, required=True, help="ring ranks (cp, or cp / cp_ulysses for hybrid)")
    ctx.add_argument("--out", help="write a PNG of the chunk assignment and ring steps here")


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="choose the layout for a model on a cluster: step time, MFU and memory per GPU",
        epilog="example: meshtron plan --model.name=llama3-70b --gpus 64 --gpu h100 --seq-len 8192 "
        "--global-batch 256; extra --model.key=value flags override the model",
    )
    plan.add_argument("--config", help="TOML config whose model is planned (default: --model.* flags)")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    plan.add_argument("--gpu", required=True, help="a100-40gb, a100-80gb, h100, h800, h200, b200, or cpu")
    plan.add_argument("--gpus-per-node", type=int, help="GPUs per NVLink domain (default: the GPU's, 8)")
    plan.add_argument("--intra-node-gbps", type=float, help="NVLink Gb/s per GPU per direction")
    plan.add_argument("--inter-node-gbps", type=float, help="network Gb/s per GPU per direction")
    plan.add_argument("--seq-len", type=int, required=True)
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    plan.add_argument("--dtype", default="bf16", help="bf16 or fp8 (the matmul peak used)")
    plan.add_argument("--layout", default="", help='keys to hold, e.g. "tp=8,pp=2,recompute=selective"')
    plan.add_argument("--top", type=int, default=5, help="layouts listed (default 5)")
    plan.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="MoE: the busiest expert rank's tokens over the mean (default 1, balanced; a run's "
        "metrics report moe_imbalance)",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON list of the ranked layouts")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, unknown, argv)
        if args.command == "verify":
            return cmd_verify(args, unknown)
        if args.command == "plan":
            return cmd_plan(args, unknown)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command == "mesh":
            return cmd_mesh(args)
        if args.command == "schedule":
            return cmd_schedule(args)
        if args.command == "context":
            return cmd_context(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_prepare_data(args)
    except (ConfigError, DataError, CheckpointError) as err:
        # User errors (configs, layouts, data) get a message, not a traceback.
        print(f"meshtron: error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        print(f"meshtron: error: {err}", file=sys.stderr)
        return 3


def exit_rank(code: int) -> None:
    """End a process: a rank that torch's elastic launcher started (torchrun, `--nproc`) leaves without
    the interpreter's exit-time destructors, once its output is flushed. Its process group is destroyed
    already; tearing down gloo's threads again at exit has aborted ranks of finished pipeline runs
    ("terminate called without an active exception"), failing a run that had finished."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    """The `meshtron` command."""
    exit_rank(main())


if __name__ == "__main__":
    entry()
