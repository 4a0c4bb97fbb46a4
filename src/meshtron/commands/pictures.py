"""`meshtron mesh`, `schedule` and `context`: print and draw a layout, a pipeline schedule, a ring."""

from __future__ import annotations

import argparse

from meshtron.config.schema import ConfigError


def cmd_mesh(args: argparse.Namespace) -> int:
    from meshtron.config.layout import ParallelDims
    from meshtron.pictures.mesh import draw_mesh

    try:
        dims = ParallelDims(
            pp=args.pp,
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            cp=args.cp,
            tp=args.tp,
            ep=args.ep,
            etp=args.etp,
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
    from meshtron.config.schema import SPLIT_BACKWARD, V_SCHEDULES
    from meshtron.schedules.build import build_schedule, simulate

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
        from meshtron.pictures.pipeline import draw_timeline

        title = (
            f"{args.schedule}, pp={args.pp}, vpp={args.vpp}, {args.microbatches} micro-batches: "
            f"bubble {100 * sim.bubble_fraction:.1f}%"
        )
        print(f"picture written to {draw_timeline(sim.timeline, args.out, title, args.vpp)}")
    return 0


def cmd_context(args: argparse.Namespace) -> int:
    from meshtron.pictures.context import draw_assignment, ring_steps_table, ring_work

    if args.ring < 1:
        raise ConfigError([f"--ring={args.ring} must be positive"])
    if args.documents:
        return _context_documents(args)
    print(ring_steps_table(args.ring))
    for zigzag in (True, False):
        work = ", ".join(f"{w:g}" for w in ring_work(args.ring, zigzag))
        print(f"attention work per rank ({'zigzag' if zigzag else 'contiguous'} chunks): {work}")
    if args.out:
        print(f"picture written to {draw_assignment(args.ring, args.out)}")
    return 0


def _context_documents(args: argparse.Namespace) -> int:
    """`meshtron context --documents`: which ring steps a document mask skips, and its picture."""
    from meshtron.pictures.documents import draw_documents, ring_documents_table

    try:
        lengths = [int(n) for n in args.documents.split(",")]
        print(ring_documents_table(lengths, args.ring))
    except ValueError as err:
        raise ConfigError([f"--documents={args.documents}: {err}"]) from None
    if args.out:
        print(f"picture written to {draw_documents(lengths, args.ring, args.out)}")
    return 0
