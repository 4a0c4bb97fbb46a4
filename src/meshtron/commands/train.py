"""`meshtron train` and `meshtron verify`: check the config for the world it will run on, then train (on
N local ranks started through torch's elastic launcher, or under torchrun's), or compare the layout with
one device on a shrunk model."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from meshtron.checkpoint import CheckpointError
from meshtron.commands.dry_run import resolved
from meshtron.commands.memory_check import too_big
from meshtron.commands.rank_errors import ERROR_DIR, first_rank_error
from meshtron.config.schema import Config, refuse
from meshtron.rules.checks import check, config_notes, load_config
from meshtron.train import TrainingInterrupted, catch_sigint, sigint_received


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


LAUNCHER_FLAGS = ("--nproc", "--max-restarts")


def rank_argv(argv: Sequence[str]) -> list[str]:
    """`argv` without the launcher's own flags (as "--flag=N" or "--flag N"): what the ranks run, so
    that they do not launch again."""
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
    return cleaned


def _launch(nproc: int, max_restarts: int, argv: Sequence[str], extra: Sequence[str], cfg: Config) -> int:
    """Start `nproc` local ranks of `meshtron train` through torch's elastic launcher (what torchrun runs);
    when a rank dies, the launcher restarts them all up to `max_restarts` times, and they resume from the
    newest complete checkpoint (Trainer.resume_if_asked). `extra`: overrides for the ranks only (what
    parallel.auto chose); `cfg`: theirs, for the line an interrupt ends with (commands/interrupt.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    from meshtron.commands import interrupt

    launcher_args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            "--module",
            "meshtron",
            *rank_argv(argv),
            *extra,
        ]
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The ranks' own argv is the launcher's rewrite; environment.json records what the user typed.
    os.environ["MESHTRON_COMMAND"] = shlex.join(["meshtron", *argv])
    with tempfile.TemporaryDirectory(prefix="meshtron-errors-") as errors:
        os.environ[ERROR_DIR] = errors  # each failing rank leaves its message there (main.py)
        # The launcher's own report of a failure (a table of exit codes) says less than the rank's message.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_NoDeathSignal())
        try:
            run(launcher_args)
        except (SignalException, KeyboardInterrupt) as err:  # Ctrl-C: the ranks are gone (or never began)
            if isinstance(err, SignalException) and err.sigval != signal.SIGINT:
                raise
            return interrupt.end_launch(cfg, nproc, Path(errors))
        except Exception as err:  # the launcher raises ChildFailedError with each rank's exit status
            print(f"meshtron: training failed: {first_rank_error(Path(errors), err)}", file=sys.stderr)
            return 1
    return 0


class _NoDeathSignal(logging.Filter):
    """Drops the launcher's own warning of a Ctrl-C ("Received 2 death signal, shutting down workers"):
    the line the interrupt ends with says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in str(record.msg)


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: Sequence[str]) -> int:
    if args.profile_steps:  # "3,4" or "3-4": profile.steps = [3, 4]
        overrides = [*overrides, f"--profile.steps=[{args.profile_steps.replace('-', ',')}]"]
    cfg = load_config(args.config, overrides)
    say_notes(args.config, overrides)
    world_size = args.nproc or int(os.environ.get("WORLD_SIZE", 1))
    if cfg.fault_tolerance.enabled and "MESHTRON_REPLICA_GROUP" in os.environ:  # one replica group's ranks
        world_size *= cfg.parallel.dp_replicate
    rank_flags: list[str] = []
    if cfg.parallel.auto:  # the planner picks the keys left open, before any rank starts
        from meshtron.commands.auto_layout import announce, choose_layout, explicit_keys

        choice = choose_layout(cfg, world_size, explicit_keys(args.config, overrides), _under_launcher())
        announce(choice)
        cfg, rank_flags = choice.cfg, choice.rank_flags()
    check(cfg, world_size)  # every problem reported before any process starts
    from meshtron.train.setup import check_data

    check_data(cfg)  # and the data's, alike
    if args.dry_run:  # after check: a layout a real run refuses is refused here the same way
        from meshtron.commands.dry_run import dry_run

        report, refusal = dry_run(cfg, world_size, " ".join([args.config, *overrides]))
        print(report, flush=True)
        refuse([refusal] if refusal else [])  # after the report it is about
        return 0
    refusal = too_big(resolved(cfg, world_size), world_size)  # before any rank allocates
    refuse([refusal] if refusal else [])
    if not (cfg.checkpoint.resume or _under_launcher()):  # (launched ranks ask it too: setup.py)
        from meshtron.train.setup import earlier_run

        if problem := earlier_run(cfg):  # before any rank starts, as the checks above
            raise CheckpointError(problem)
    if args.nproc and args.nproc > 1 and not _under_launcher():
        if cfg.fault_tolerance.enabled:  # a launcher per replica group (commands/replica_launch.py)
            from meshtron.commands.replica_launch import launch_replica_groups

            ranks = [*rank_argv(argv), *rank_flags]
            return launch_replica_groups(args.nproc, args.max_restarts, ranks, argv, cfg)
        return _launch(args.nproc, args.max_restarts, argv, rank_flags, cfg)
    return _train_here(cfg, world_size)


def _train_here(cfg: Config, world_size: int) -> int:
    """Train in this process (one rank of a job, or a job of one); Ctrl-C ends it with one line."""
    from meshtron.commands import interrupt
    from meshtron.train.threads import choose_one_rank_threads
    from meshtron.train.trainer import train

    if world_size == 1 and (line := choose_one_rank_threads(cfg.run.device)):  # (train/threads.py)
        print(line, flush=True)
    catch_sigint()
    try:
        train(cfg)
    except TrainingInterrupted as stop:
        completed = stop.completed
    except BaseException:  # set-up cut short
        if not sigint_received():
            raise
        completed = None
    else:
        return 0
    if _under_launcher():
        return interrupt.end_rank(cfg, completed, os.environ.get(ERROR_DIR))
    interrupt.say(interrupt.resume_line(cfg, completed, "meshtron train"))
    return interrupt.EXIT_CODE


def say_notes(path: str | None, overrides: Sequence[str]) -> None:
    """How the file and the overrides merged (checks.config_notes), once per job: here, or on rank 0
    of a torchrun job (the ranks `--nproc` starts leave it to the launcher, which said it)."""
    if os.environ.get("RANK", "0") == "0" and ERROR_DIR not in os.environ:
        for line in config_notes(path, overrides):
            print(f"meshtron: {line}", flush=True)


def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    say_notes(args.config, overrides)
    check(cfg, args.nproc)  # the layout as given must be valid before it is shrunk
    from meshtron.commands.verify import verify

    return verify(cfg, args.nproc, args.steps, args.tolerance)
