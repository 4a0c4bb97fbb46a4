"""Layout fuzzing: random valid layouts over every dim, each compared with the single-device run.

A drawn layout picks degrees for pp (with vpp and every schedule, V ones included), dp_replicate, dp_shard (ZeRO 1/2/3),
cp (every implementation), tp (with or without sp), ep (every dispatcher, etp 1 or tp, ep folded over the tp ranks), a recompute mode,
AdamW or Muon (fp32 Newton-Schulz), a dense or MoE model (or DeepSeek-V3's architecture with multi-token
prediction), tied or untied embeddings and MHA/GQA/MQA, on at most `max_world` ranks; draws the
config's own rules refuse (validate, not_yet_supported) are redrawn. Each layout runs 6 steps and is
compared with the single-device run by parity.py's tolerances (loss rel <= 1e-5 at every step, step-1
gradients rel L2 <= 1e-5), and its second step's bytes with plan/comm.py's formula wherever that
formula is exact (`exact_groups`).

With `--resume` each drawn layout trains 3 steps and saves; a second layout drawn for the same model and
optimizer (an MoE model's micro-batch too; one device among its choices) resumes that checkpoint, and
its losses of steps 4-6 must be the uninterrupted single-device run's: the weights, the optimizer state,
the data position and the routers' balancing bias carried between any two layouts.

    python -m meshtron.testing.fuzz --layouts 20 --seed 7       # prints each layout and its verdict
    python -m meshtron.testing.fuzz --layouts 20 --seed 7 --resume --wide

A layout that fails is a composition bug: keep its overrides as a regression case in
tests/test_fuzz.py once fixed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from meshtron.comm.workers import WorkerPool, close_pools
from meshtron.plan.comm import exact_groups, step_bytes
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import (
    STEPS,
    assert_losses_match,
    assert_parity,
    merged,
    pipelined,
    reference,
    resumed_rows,
    run_layout,
    save_after,
)
from meshtron.testing.tiny import MOE, TINY

GLOBAL_BATCH = 8


def runs(overrides: list[str], world: int) -> bool:
    """Whether `overrides` (after TINY) is a layout this version runs on `world` ranks."""
    try:
        check(load_config(None, [*TINY, *overrides]), world)
    except ValueError:
        return False
    return True


def _model(rng: random.Random, pp: int, vpp: int) -> list[str]:
    layers = 4 if pp * vpp > 2 or rng.random() < 0.3 else 2
    model = [*MOE, "--model.router_bias_rate=0.01"] if rng.random() < 0.5 else []
    model += [f"--model.n_layers={layers}", f"--model.n_kv_heads={rng.choice([1, 2, 4])}"]
    if rng.random() < 0.4:
        model += ["--model.tie_embeddings=true", "--model.vocab_size=301"]
    return model


def _parallel(rng: random.Random, moe: bool) -> tuple[list[str], int]:
    degrees = {dim: rng.choice([1, 1, 2]) for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    if rng.random() < 0.15:
        degrees["cp"] = 4
    world = 1
    for size in degrees.values():
        world *= size
    p = [f"--parallel.{dim}={size}" for dim, size in degrees.items()]
    p.append(f"--parallel.zero={rng.choice([1, 2, 3])}")
    if degrees["cp"] > 1:
        impl = rng.choice(["ring", "allgather", "alltoall"] + (["hybrid"] if degrees["cp"] == 4 else []))
        p += [f"--parallel.cp_impl={impl}"] + (["--parallel.cp_ulysses=2"] if impl == "hybrid" else [])
    if degrees["tp"] > 1 and rng.random() < 0.5:
        p.append("--parallel.sp=true")
    if degrees["pp"] > 1:
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"])
        p += [f"--parallel.pp_schedule={schedule}"] + (
            ["--parallel.vpp=2"] if schedule in ("interleaved", "zbv", "dualpipev") else []
        )
    if moe:
        folded = degrees["dp_shard"] * degrees["cp"]
        p.append(f"--parallel.ep={rng.choice([d for d in (1, 2, 2, 4) if folded % d == 0])}")
        p.append(f"--parallel.ep_dispatch={rng.choice(['alltoall', 'allgather'])}")
        if degrees["tp"] > 1:
            p.append(f"--parallel.etp={rng.choice([1, degrees['tp']])}")
    p.append(f"--training.recompute={rng.choice(['none', 'selective', 'full'])}")
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    p.append(
        f"--training.micro_batch={rng.choice([m for m in (1, 2, 4, 8) if (GLOBAL_BATCH // dp) % m == 0])}"
    )
    return p, world


def draw_layout(rng: random.Random, max_world: int = 8) -> tuple[list[str], int]:
    """(overrides after TINY, world size) of a random layout this version accepts."""
    while True:
        parallel, world = _parallel(rng, moe=rng.random() < 0.5)
        vpp = 2 if "--parallel.vpp=2" in parallel else 1
        pp = 2 if "--parallel.pp=2" in parallel else 1
        model = _model(rng, pp, vpp)
        if "--model.name=tiny-moe" not in model:
            parallel = [o for o in parallel if not o.startswith(("--parallel.ep", "--parallel.etp"))]
        elif not any(o.startswith("--parallel.ep=") for o in parallel):
            continue
        overrides = [*model, *parallel]
        if not (2 <= world <= max_world and runs(overrides, world)):
            continue
        drawn = _with_muon(rng, _with_fold(rng, _with_dedup(rng, overrides), world), world)
        return _with_deepseek(rng, drawn, world), world


def _with_dedup(rng: random.Random, overrides: list[str]) -> list[str]:
    """Half the all-to-all dispatches become dedup ones, drawn last so that the layouts drawn before
    dedup existed (the CI seed list) stay what they were otherwise."""
    if "--parallel.ep_dispatch=alltoall" not in overrides or rng.random() >= 0.5:
        return overrides
    return [
        o.replace("=alltoall", "=dedup") if o.startswith("--parallel.ep_dispatch") else o for o in overrides
    ]


def _with_fold(rng: random.Random, overrides: list[str], world: int) -> list[str]:
    """Half the etp = 1 layouts double ep onto the tp ranks (MoE parallel folding: ep over dp_shard x cp
    x tp), when the doubled layout is valid; drawn last, like dedup."""
    if "--parallel.etp=1" not in overrides or rng.random() >= 0.5:
        return overrides
    ep = int(next(o for o in overrides if o.startswith("--parallel.ep=")).split("=")[1])
    folded = [f"--parallel.ep={2 * ep}" if o.startswith("--parallel.ep=") else o for o in overrides]
    return folded if runs(folded, world) else overrides


# Muon with fp32 Newton-Schulz: exact against one device in every layout (bf16's rounding is not).
MUON = ["--training.optimizer=muon", "--training.muon_ns_dtype=fp32"]


def _with_muon(rng: random.Random, overrides: list[str], world: int) -> list[str]:
    """A quarter of the layouts train with Muon, where the layout runs it; drawn last, like dedup."""
    if rng.random() >= 0.25:
        return overrides
    return [*overrides, *MUON] if runs([*overrides, *MUON], world) else overrides


# DeepSeek-V3's architecture, small: latent attention, sigmoid group-limited routing with a correction
# bias and the first layer dense, and one multi-token prediction depth.
DEEPSEEK = ["--model.name=tiny-deepseek", "--model.mtp_depth=1"]


def _with_deepseek(rng: random.Random, overrides: list[str], world: int) -> list[str]:
    """A quarter of the layouts train DeepSeek-V3's architecture in place of the drawn model (its
    experts where the draw had them, none where it was dense), where the layout runs it; drawn last."""
    if rng.random() >= 0.25:
        return overrides
    moe = "--model.name=tiny-moe" in overrides
    model = [*DEEPSEEK, *([] if moe else ["--model.n_experts=0"])]
    drop = (
        "--model.name=",
        "--model.n_kv_heads=",
        "--model.shared_expert_gate=",
        "--model.router_bias_rate=",
    )
    switched = [*model, *(o for o in overrides if not o.startswith(drop))]
    return switched if runs(switched, world) else overrides


# `--wide` draws these too, each a third of the time where the layout runs it (a separate stream, so the
# CI seed list's layouts stay what they are): per-op recompute (rerunning MoE dispatches), DeepEP-style
# two-hop dispatch over two-rank "nodes", the embedding and the head as pipeline chunks of their own,
# torch's FSDP2 or SimpleFSDP for ZeRO-3 (one of the two, evenly), MLA's latent exchange under cp, and
# tiny gradient buckets. Each entry: the key its options set, and its alternatives.
WIDE = (
    ("--training.recompute=", (["--training.recompute=op", "--training.op_recompute_dispatch=rerun"],)),
    ("--parallel.ep_dispatch=", (["--parallel.ep_dispatch=hierarchical", "--run.gpus_per_node=2"],)),
    (
        "--parallel.pp_embedding_layers=",
        (["--parallel.pp_embedding_layers=1", "--parallel.pp_head_layers=1"],),
    ),
    ("--parallel.fsdp_impl=", (["--parallel.fsdp_impl=simple"], ["--parallel.fsdp_impl=torch"])),
    ("--parallel.cp_exchange=", (["--parallel.cp_exchange=latent"],)),
    ("--parallel.bucket_mb=", (["--parallel.bucket_mb=0.01"],)),
)


def with_wide(rng: random.Random, overrides: list[str], world: int) -> list[str]:
    """`overrides` with WIDE's options drawn in, each replacing the key it sets, kept where valid: of an
    entry's alternatives, in a random order, the first the layout runs."""
    for key, alternatives in WIDE:
        if rng.random() >= 1 / 3:
            continue
        order = rng.sample(alternatives, len(alternatives)) if len(alternatives) > 1 else alternatives
        for options in order:
            candidate = [o for o in overrides if not o.startswith(key)] + options
            if runs(candidate, world):
                overrides = candidate
                break
    return overrides


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def coverage(overrides: list[str]) -> set[str]:
    """What a layout exercises: its dims of size > 1 and every option it sets (for the CI seed list)."""

    def value(key: str) -> str | None:
        return next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"--{key}=")), None)

    found = {dim for dim in MESH_DIMS if int(value(f"parallel.{dim}") or 1) > 1}
    deepseek = value("model.name") == "tiny-deepseek"
    found |= {f"zero{value('parallel.zero')}", f"recompute:{value('training.recompute')}"}
    found |= {
        f"kv_heads:{value('model.n_kv_heads')}",
        "moe"
        if value("model.name") == "tiny-moe" or (deepseek and value("model.n_experts") != "0")
        else "dense",
    }
    found |= {"deepseek"} if deepseek else set()
    found |= {"sp"} if value("parallel.sp") == "true" else set()
    found |= {"tied"} if value("model.tie_embeddings") == "true" else set()
    found |= {"muon"} if value("training.optimizer") == "muon" else set()
    found |= {f"schedule:{value('parallel.pp_schedule') or '1f1b'}"} if "pp" in found else set()
    found |= {f"cp_impl:{value('parallel.cp_impl') or 'ring'}"} if "cp" in found else set()
    found |= {f"ep_dispatch:{value('parallel.ep_dispatch')}"} if "ep" in found else set()
    found |= {"etp1"} if value("parallel.etp") == "1" else set()
    folded_over = int(value("parallel.dp_shard") or 1) * int(value("parallel.cp") or 1)
    found |= {"ep_over_tp"} if int(value("parallel.ep") or 1) > folded_over else set()
    return found


def micro_batch_of(overrides: list[str]) -> int:
    return int(next(o for o in reversed(overrides) if o.startswith("--training.micro_batch=")).split("=")[1])


def check_layout(pools: Any, overrides: list[str], world: int) -> None:
    """Run `overrides` on `world` ranks and assert parity with the single-device run, and the second
    step's bytes of every group plan/comm.py holds exact equal to its formula on each stage's first data-
    parallel rank. `pools(n)` gives a WorkerPool of n ranks."""
    results = pools(world).run(run_layout, [*TINY, *overrides])
    model = [o for o in overrides if o.startswith(("--model.", "--training.optimizer", "--training.muon_"))]
    ref = reference(pools(1), model, micro_batch_of(overrides))
    assert_parity(merged(results) if pipelined(overrides) else results[0], ref)
    cfg = load_config(None, [*TINY, *overrides, f"--parallel.cp_exchange={results[0]['cp_exchange']}"])
    exact = exact_groups(cfg)
    for result in results:
        if result["dp_first"]:
            formula = step_bytes(cfg, world, result["pp_rank"])
            counted = result["rows"][1]["comm_bytes_by_group"]
            for group in exact & (set(formula) | set(counted)):
                got, want = counted.get(group, 0.0), formula.get(group, 0.0)
                assert abs(got - want) <= 1e-9 * max(want, 1.0), (group, result["pp_rank"], got, want)


# --resume: a run saved under one layout resumes under another. The second is drawn for the first's model
# and optimizer (one device among its choices), and for an MoE model its micro-batch (the balancing loss
# is a statistic of each micro-batch's tokens; a dense model's loss is not); it resumes the checkpoint of
# step SAVED_AT, and its losses from there on must be the uninterrupted single-device run's.
SAVED_AT = 3
KEPT_ON_RESUME = ("--model.", "--training.optimizer", "--training.muon_")


def draw_resumed_layout(rng: random.Random, first: list[str], max_world: int = 8) -> tuple[list[str], int]:
    """(overrides after TINY, world size) of a random valid layout for `first`'s model and optimizer (and
    an MoE model's micro-batch): where a run saved under `first` resumes."""
    kept = [o for o in first if o.startswith(KEPT_ON_RESUME)]
    moe = load_config(None, [*TINY, *kept]).model.is_moe
    kept += [f"--training.micro_batch={micro_batch_of(first)}"] if moe else []
    while True:
        parallel, world = _parallel(rng, moe)
        if moe:
            parallel = [o for o in parallel if not o.startswith("--training.micro_batch=")]
        else:
            parallel = [o for o in parallel if not o.startswith(("--parallel.ep", "--parallel.etp"))]
        overrides = [*kept, *parallel]
        if world <= max_world and runs(overrides, world):
            return _with_fold(rng, _with_dedup(rng, overrides), world), world


def check_resume(
    pools: Any, first: list[str], first_world: int, second: list[str], second_world: int, directory: Path
) -> None:
    """Train `first` on `first_world` ranks for SAVED_AT steps and save; resume under `second` on
    `second_world` ranks to step STEPS: each loss within parity.py's tolerance of the single-device
    run's (wrong weights move the first, wrong optimizer state the later ones)."""
    saved = directory / "first"
    layout = [*TINY, *first, f"--run.dir={saved}", f"--checkpoint.every={SAVED_AT}"]
    pools(first_world).run(save_after, layout, SAVED_AT)
    resume = ["--checkpoint.resume=true", f"--checkpoint.dir={saved / 'checkpoints'}"]
    results = pools(second_world).run(
        resumed_rows, [*TINY, *second, f"--run.dir={directory / 'second'}", *resume], STEPS
    )
    model = [o for o in first if o.startswith(KEPT_ON_RESUME)]
    ref = reference(pools(1), model, micro_batch_of(first))
    assert_losses_match(results[-1] if pipelined(second) else results[0], ref["rows"][SAVED_AT:])


def _draw(args: argparse.Namespace, rngs: tuple[random.Random, ...]) -> list[tuple[list[str], int]]:
    """One case of the sweep: a layout (with WIDE's options under --wide), and under --resume the
    layout that resumes its checkpoint after it."""
    rng, wide, resume = rngs
    overrides, world = draw_layout(rng, args.max_world)
    layouts = [(with_wide(wide, overrides, world) if args.wide else overrides, world)]
    if args.resume:
        second, world = draw_resumed_layout(resume, layouts[0][0], args.max_world)
        layouts.append((with_wide(wide, second, world) if args.wide else second, world))
    return layouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshtron.testing.fuzz", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--layouts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--wide", action="store_true", help="draw the options of WIDE too")
    parser.add_argument(
        "--resume", action="store_true", help=f"save each layout at step {SAVED_AT}, resume it on another"
    )
    args = parser.parse_args(argv)
    pools: dict[int, WorkerPool] = {}

    def pool(n: int) -> WorkerPool:
        if n not in pools or pools[n].broken:
            pools[n] = WorkerPool(n, timeout_s=300)
        return pools[n]

    rngs = (random.Random(args.seed), random.Random(-args.seed - 1), random.Random(f"resume {args.seed}"))
    failures = 0
    try:
        for index in range(args.layouts):
            layouts = _draw(args, rngs)
            try:
                if args.resume:
                    with tempfile.TemporaryDirectory() as directory:
                        check_resume(pool, *layouts[0], *layouts[1], Path(directory))
                else:
                    check_layout(pool, *layouts[0])
                verdict = "ok"
            except Exception:  # noqa: BLE001 - every failing layout is reported, the sweep goes on
                failures += 1
                verdict = "FAILED\n" + traceback.format_exc(limit=3)
            drawn = " -> ".join(f"world {world}: {' '.join(overrides)}" for overrides, world in layouts)
            print(f"[{index}] {drawn}: {verdict}", flush=True)
    finally:
        close_pools(list(pools.values()))
    print(f"{args.layouts - failures} of {args.layouts} layouts match the single-device run")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
