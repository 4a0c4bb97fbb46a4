"""`meshtron` command line: train, verify, plan, mesh, schedule, context, prepare-data, export, generate.

This module holds the parser and hands each command to its own module (train.py, plan.py, pictures.py,
data.py, export.py; verify.py and dry_run.py behind train's), importing it only when it runs."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from meshtron.checkpoint import CheckpointError
from meshtron.config.schema import ConfigError, PipelineSchedule
from meshtron.data import DataError
from meshtron.train import TrainingDiverged

DESCRIPTION = """\
meshtron trains Llama-family models (dense and mixture-of-experts) with every parallelism, on CPUs (gloo)
or GPUs, and checks a layout before a long job.

  the demo:        meshtron train --config configs/demo.toml
  before a job:    meshtron train ... --dry-run, meshtron verify, meshtron plan
  pictures:        meshtron mesh, meshtron schedule, meshtron context
  data and models: meshtron prepare-data, meshtron export, meshtron generate

`meshtron COMMAND --help` lists a command's flags."""


class _WithOverrides(argparse.HelpFormatter):
    """The usage line ends with the --section.key=value overrides a command takes besides its flags."""

    overrides = "[--section.key=value ...]"

    def _format_usage(self, usage, actions, groups, prefix) -> str:  # noqa: ANN001 - argparse's own
        return super()._format_usage(usage, actions, groups, prefix).rstrip() + f" {self.overrides}\n\n"


class _WithModelOverrides(_WithOverrides):
    overrides = "[--model.key=value ...]"


# `export --dtype`: the configs' spellings (training.dtype) and torch's both name the two dtypes.
EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def _export_dtype(text: str) -> str:
    if text not in EXPORT_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not fp32 or bf16 (float32, bfloat16 work too)")
    return EXPORT_DTYPES[text]


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
    export.add_argument(
        "--dtype",
        default="float32",
        type=_export_dtype,
        metavar="{fp32,bf16}",
        help="the weights' dtype in the safetensors (default fp32; float32 and bfloat16 work too)",
    )
    export.add_argument(
        "--max-shard-gb",
        type=float,
        default=5.0,
        help="safetensors files of at most this many GB (10^9 bytes), with an index past one, as transformers",
    )
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
    parser = argparse.ArgumentParser(
        prog="meshtron", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model; extra --section.key=value flags override the config",
        epilog="example: meshtron train --config configs/demo.toml --training.steps=50; any key of the "
        "config (src/meshtron/config/schema.py) may be overridden as --section.key=value",
        formatter_class=_WithOverrides,
    )
    train.add_argument("--config", required=True, help="TOML config file (see configs/)")
    train.add_argument(
        "--nproc", type=int, default=0, help="launch this many local ranks (gloo on CPU, NCCL on GPU)"
    )
    verify = sub.add_parser(
        "verify",
        help="before a big job: run its layout and one device on a shrunk copy of the model and compare",
        epilog="example: meshtron verify --config configs/mixtral-8x7b.toml --nproc 8 --parallel.tp=2 "
        "--parallel.dp_shard=4 --parallel.ep=4; --section.key=value flags override the config",
        formatter_class=_WithOverrides,
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
        "--profile-steps",
        metavar="FIRST,LAST",
        help="trace steps FIRST..LAST (1-based) on every rank into <run.dir>/traces (profile.steps)",
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
    prep.add_argument("--split", default="train", help="the split of a Hugging Face dataset input")
    prep.add_argument("--text-field", default="text", help="the column of a Hugging Face dataset input")
    prep.add_argument("--workers", type=int, default=1, help="tokenize in this many processes")
    prep.add_argument(
        "--chat",
        action="store_true",
        help='.jsonl rows of {"messages": [{"role", "content"}, ...]}, rendered with the chat template beside '
        "--tokenizer (chat_template.jinja, chat_template.json or tokenizer_config.json); only assistant turns "
        "count in the loss",
    )
    return parser


MESH_DEGREES = {
    "pp": "pipeline stages",
    "dp-replicate": "data-parallel replicas (DDP, or HSDP's replicate dim)",
    "dp-shard": "data-parallel ranks sharding the state (ZeRO / FSDP)",
    "cp": "context parallel: ranks splitting each sequence",
    "tp": "tensor parallel: ranks splitting each layer",
    "ep": "expert parallel: ranks splitting the experts (over dp-shard x cp; with --etp 1 tp's too)",
}


def _add_picture_parsers(sub: argparse._SubParsersAction) -> None:
    """`mesh`, `schedule` and `context`: print and draw a layout, a pipeline schedule, a ring."""
    mesh = sub.add_parser("mesh", help="print and draw the rank layout of a parallel configuration")
    for dim, what in MESH_DEGREES.items():
        mesh.add_argument(
            f"--{dim}", type=int, default=1, help=f"{what} (parallel.{dim.replace('-', '_')}, default 1)"
        )
    mesh.add_argument(
        "--etp",
        type=int,
        default=0,
        help="expert tensor parallel: 0 or tp splits each expert over tp; 1 keeps experts whole, and ep "
        "may take tp ranks (parallel.etp, default 0)",
    )
    mesh.add_argument(
        "--cp-ulysses",
        type=int,
        default=1,
        help="hybrid context parallel: all-to-all ranks in each ring rank",
    )
    mesh.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
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
    ctx.add_argument(
        "--documents",
        help="document lengths packed in one window, e.g. 5,11,3,13: the document mask and the ring steps it skips",
    )


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="choose the layout for a model on a cluster: step time, MFU and memory per GPU",
        epilog="example: meshtron plan --model.name=llama3-70b --gpus 64 --gpu h100 --seq-len 8192 "
        "--global-batch 256; extra --model.key=value flags override the model, and "
        "--parallel.ep_dispatch=hierarchical prices DeepEP's two-hop dispatch for MoE",
        formatter_class=_WithModelOverrides,
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
    plan.add_argument(
        "--overlap",
        help="what the modelled framework hides behind compute, comma-separated from dp_reduce, dp_gather, "
        "fsdp_prefetch, tp, cp, ep, pp, or none (default: meshtron's own, printed in the header)",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON list of the ranked layouts")
    plan.add_argument(
        "--failures-per-gpu-day",
        type=float,
        help="also report the best layout's goodput under this failure rate: checkpoint-restart at the "
        "Young/Daly interval against healing one replica group from a live one (docs/fault-tolerance.md)",
    )
    plan.add_argument(
        "--storage-gbps",
        type=float,
        default=2000.0,
        help="GB/s the whole job writes and reads checkpoints at (default 2000: the 2 TB/s Llama 3's "
        "storage sustained)",
    )
    plan.add_argument(
        "--restart-s", type=float, default=120.0, help="seconds to restart failed ranks (default 120)"
    )


def _run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str], argv: list[str]
) -> int:
    """The command's own module does the work, imported only when its command runs (so `meshtron plan`,
    `mesh` and `schedule` never import torch)."""
    _refuse_unknown_flags(parser, args.command, unknown)
    if args.command in ("train", "verify"):
        from meshtron.commands.train import cmd_train, cmd_verify

        return cmd_train(args, unknown, argv) if args.command == "train" else cmd_verify(args, unknown)
    if args.command == "plan":
        from meshtron.commands.plan import cmd_plan

        return cmd_plan(args, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("mesh", "schedule", "context"):
        from meshtron.commands import pictures

        return getattr(pictures, f"cmd_{args.command}")(args)
    if args.command in ("export", "generate"):
        from meshtron.commands import export

        return getattr(export, f"cmd_{args.command}")(args)
    from meshtron.commands.data import cmd_prepare_data

    return cmd_prepare_data(args)


def _refuse_unknown_flags(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """A flag the command does not have (not a --section.key=value override), with the nearest it has:
    `--nprocs` is not an abbreviation of `--nproc`, so argparse alone passes it on as an override."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    named = [t.split("=", 1)[0] for t in unknown if re.match(r"--?[A-Za-z]", t)]
    bad = [flag for flag in named if "." not in flag]
    if not bad:
        return
    said = []
    for flag in bad:
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
        said.append(f"{flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    sub.error(
        f"unknown flag{'s' if len(bad) > 1 else ''} {', '.join(said)}; `meshtron {command} --help` lists them"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run its command; the exit status (2: a user error, 3: training diverged, 130:
    interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        return _run(parser, args, unknown, argv)
    except (ConfigError, DataError, CheckpointError) as err:
        # User errors (configs, layouts, data) get a message, not a traceback.
        _report(err)
        return 2
    except TrainingDiverged as err:
        _report(err)
        return 3
    except KeyboardInterrupt:  # Ctrl-C outside training's steps (which say more: commands/interrupt.py)
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # a launched rank leaves the saying to its launcher
            print("meshtron: interrupted", file=sys.stderr)
        return 130


def _report(err: Exception) -> None:
    """The error on this process's stderr and, on a rank that `meshtron train --nproc` started, in the
    launcher's error directory too: the launcher ends with the first rank's message."""
    print(f"meshtron: error: {err}", file=sys.stderr)
    errors = os.environ.get("MESHTRON_ERROR_DIR")
    if errors and "RANK" in os.environ:
        with contextlib.suppress(OSError):
            (Path(errors) / f"rank-{os.environ['RANK']}.txt").write_text(f"{err}\n")


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
