"""Benchmark: meshtron's context-parallel attentions (ring, allgather, alltoall, hybrid) on one long-sequence
model, against the same model on one rank (cp = 1), gloo ranks on CPU (fp32).

Every implementation runs the full training step of `meshtron train` (Trainer.step: forward, loss,
backward, gradient reduction over cp, clipping, AdamW) on the same batches; the check step's loss must
equal the single-device run's before anything is timed. Reported: step time, the peak of the step's
allocations per rank against cp = 1, the attention traffic over the cp group(s) against the formula of
docs/context-parallel.md, and for the ring how much of its point-to-point traffic the overlap hid:
1 − (time spent waiting for hops after the overlapped compute) / (the same hops with nothing to
overlap). PyTorch's own context parallel (torch.distributed.tensor.experimental.context_parallel) is
tried on one attention call of the same shape; the reason it cannot run here is reported as it is raised.
Method and analysis: benchmarks/RESULTS.md. E.g. `python benchmarks/context_parallel.py --steps 6`.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Clock, Pair, Runner
from reporting import mib, ms, table

from meshtron.comm.mesh import ParallelMesh
from meshtron.parallel.context import RingPass
from meshtron.plan.memory import layer_activation_bytes
from meshtron.rules.checks import load_config
from meshtron.train.trainer import Trainer

TITLE = "## Context parallel: ring vs all-gather vs all-to-all vs hybrid (gloo, CPU)"
IMPLS = ("ring", "allgather", "alltoall", "hybrid")
MODEL = [
    "--model.dim=128",
    "--model.n_layers=2",
    "--model.n_heads=8",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=352",
    "--model.vocab_size=260",
    "--data.tokenizer=byte",
    "--training.global_batch=1",
    "--training.micro_batch=1",
    "--training.warmup_steps=2",
    "--training.steps=1000",
    "--run.plot=false",
    "--parallel.dp_shard=1",
    "--parallel.zero=1",
]


def overrides(seq: int, cp: int, impl: str, run_dir: str) -> list[str]:
    extra = [f"--parallel.cp={cp}", f"--parallel.cp_impl={impl}"] if cp > 1 else []
    if impl == "hybrid":
        extra.append("--parallel.cp_ulysses=2")
    return [*MODEL, f"--training.seq_len={seq}", f"--run.dir={run_dir}/{impl}-{cp}", *extra]


def label(impl: str, cp: int) -> str:
    return f"{impl} cp={cp}" if cp > 1 else "cp=1 (one rank)"


class TrainerStep(Runner):
    """meshtron's training step for one layout; the batches come from its own sampler (the same for all)."""

    def __init__(self, name: str, args: list[str]):
        cfg = load_config(None, args)
        dims = cfg.parallel.dims(dist.get_world_size())
        self.name, self.trainer, self.step_index = name, Trainer(cfg, ParallelMesh(dims, "cpu")), 0
        attentions = [b.attention.attend for b in self.trainer.model.layers.values()]
        self.rings = [a.inner for a in attentions if isinstance(getattr(a, "inner", None), RingPass)]

    def step(self, batch: Any, clock: Clock) -> float:
        exposed = sum(r.exposed_s for r in self.rings)
        row = self.trainer.step(self.step_index)
        clock.lap("step")
        self.step_index += 1
        clock.notes.update(
            comm=row["comm_bytes_by_group"], exposed_s=sum(r.exposed_s for r in self.rings) - exposed
        )
        return row["loss"]


def ring_hops_alone(runner: TrainerStep, repeats: int = 5) -> float:
    """Seconds of one step's ring hops (forward and backward, every layer) with no compute between them:
    what the ring would cost if none of it were hidden."""
    ring, comm = runner.rings[0], runner.trainer.comm
    cfg, n = runner.trainer.cfg, ring.group.size
    local = cfg.training.seq_len // cfg.parallel.cp * cfg.parallel.cp_split[1]  # the ring's share per rank
    kv_heads = max(cfg.model.kv_heads // cfg.parallel.cp_split[1], 1)
    kv = torch.zeros(2, cfg.training.micro_batch, kv_heads, local, cfg.model.head_size)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        # Per layer: forward n-1 K/V hops; backward n-1 K/V hops and n accumulator hops.
        for _ in range(len(runner.rings) * (3 * n - 2)):
            pending, _ = comm.sendrecv(kv, ring.group, (ring.group.rank + 1) % n, (ring.group.rank - 1) % n)
            pending.wait()
        times.append(time.perf_counter() - start)
    comm.stats.reset()
    return statistics.median(times)


def torch_context_parallel_error(seq: int) -> str:
    """Run PyTorch's experimental context parallel on one causal SDPA call; '' if it works here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 8, seq, 16) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as err:  # noqa: BLE001 - whatever it raises is the finding
        messages = []
        while err is not None:
            messages.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
            err = err.__context__
        return " <- ".join(reversed(messages))
    return ""


def bench_rank(
    seq: int, cp: int, impls: Sequence[str], warmup: int, steps: int, reference: list[float] | None
) -> harness.RankResult:
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="meshtron-bench-cp-")
    runners = [TrainerStep(label(impl, cp), overrides(seq, cp, impl, run_dir)) for impl in impls]
    pairs = [Pair(runners[0].name, r.name) for r in runners[1:]]
    result = harness.run_rounds(runners, lambda _: None, pairs, warmup, steps, reference=reference)
    rings = [r for r in runners if r.rings]
    result.extra["hops_alone_s"] = {r.name: ring_hops_alone(r) for r in rings}
    if cp > 1:
        result.extra["torch_cp"] = torch_context_parallel_error(seq)
    return result


# -- what the parent makes of the results --


def formula_bytes(seq: int, cp: int, impl: str) -> float:
    """Attention bytes per step per rank over the cp group(s) (docs/context-parallel.md#communication)."""
    cfg = load_config(None, overrides(seq, cp, impl, "."))
    m, b, layers = cfg.model, cfg.training.micro_batch, cfg.model.n_layers
    ring, u = cfg.parallel.cp_split
    k, q = m.kv_heads * m.head_size * 4, m.n_heads * m.head_size * 4
    total = 0.0
    if u > 1:
        k_moved = max(k, m.head_size * 4 * u)
        total += 2 * b * (seq // cp) * (2 * q + 2 * k_moved) * (u - 1) / u
        k = k_moved // u
    if impl == "allgather":
        total += 3 * 2 * b * seq * k * (ring - 1) / ring
    elif ring > 1:  # sends and receives each: forward and backward K/V hops, the accumulators' ring hops
        share = seq // ring
        total += 2 * (2 * 2 * b * share * k * (ring - 1) + ring * 2 * b * share * k)
    return layers * total


def tables(
    seq: int,
    cp: int,
    impls: Sequence[str],
    single: reporting.Samples,
    samples: dict[str, reporting.Samples],
    extra: dict,
) -> list[list[str]]:
    rows = []
    cfg = load_config(None, overrides(seq, 1, "ring", "."))
    for impl in ("single", *impls):
        s = single if impl == "single" else samples[label(impl, cp)]
        measured = s.measured[0].notes if s.measured else {}
        comm = measured.get("comm", {})
        attention = sum(v for g, v in comm.items() if g in ("cp", "cp_ring", "cp_ulysses"))
        formula = formula_bytes(seq, cp, impl) if impl != "single" else 0.0
        u = load_config(None, overrides(seq, cp, impl, ".").parallel.cp_split)[1] if impl != "single" else 1
        layer = layer_activation_bytes(cfg.model, 1, seq, cp=cp if impl != "single" else 1, ulysses=u)
        exposed = [n.get("exposed_s", 0.0) for rank in s.notes for n in rank]
        alone = extra.get("hops_alone_s", {}).get(s.name)
        hidden = f"{ms(statistics.median(exposed))} / {ms(alone)}" if alone else ""
        rows.append(
            [
                s.name,
                *s.timing(),
                f"{single.median / s.median:.2f}x" if impl != "single" else "1",
                mib(s.alloc_peak),
                f"{s.alloc_peak / single.alloc_peak:.2f}",
                mib(layer),
                f"{mib(attention)} / {mib(formula)}" if impl != "single" else "",
                hidden,
            ]
        )
    return [
        table(
            "layout | median step ms | p10 ms | p90 ms | speed vs cp=1 | peak step allocations MiB per rank "
            "| vs cp=1 | activations kept per layer MiB (formula) | attention comm MiB per rank: measured / formula "
            "| ring hops: ms waited after overlap / ms alone",
            rows,
            f"cp={cp}: steps (the slowest rank's), memory and traffic per rank (measured step):",
        ),
        reporting.comparison_table([Pair(label(impls[0], cp), label(i, cp)) for i in impls[1:]], samples),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__, steps=8, warmup=2)
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument(
        "--cp", type=int, nargs="+", default=[2, 4], help="cp degrees, one world each (hybrid: cp >= 4)"
    )
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    args = parser.parse_args(argv)
    report = reporting.Report(__file__, TITLE)
    print(f"cp=1 on one rank, then cp={args.cp} gloo ranks; seq {args.seq}")
    single_result = harness.run_world(1, bench_rank, args.seq, 1, ["ring"], args.warmup, args.steps, None)
    single = report.add(single_result)[label("ring", 1)]
    reference = [r.loss for r in single_result[0].records[label("ring", 1)][:1]]
    torch_cp = ""
    for cp in args.cp:
        impls = [i for i in args.impls if i != "hybrid" or cp >= 4]  # hybrid needs 1 < ulysses < cp
        results = harness.run_world(cp, bench_rank, args.seq, cp, impls, args.warmup, args.steps, reference)
        samples = report.add(results)
        report.blocks += tables(args.seq, cp, impls, single, samples, results[0].extra)
        torch_cp = results[0].extra["torch_cp"]
    cpus = os.cpu_count() or 1
    worlds = ", ".join(f"cp={c} {'oversubscribed' if c > cpus else 'one rank per core'}" for c in args.cp)
    report.facts = [
        f"every rank `torch.set_num_threads(1)`; {worlds} (an oversubscribed rank waits for the OS to "
        "schedule its peers at every exchange, so its times are noisy and its waits long)",
        f"model: {' '.join(a.removeprefix('--') for a in MODEL[:6])}, seq {args.seq}, batch 1; fp32; "
        "ZeRO-1 over the cp ranks (they hold the same parameters)",
        f"{args.steps} timed steps per layout after 1 check step and {args.warmup} warmup, plus one measured step",
        "PyTorch's context_parallel on this CPU: "
        + (f"fails, `{torch_cp}`" if torch_cp else "runs (not yet compared here)"),
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
