"""Benchmark: meshtron's tensor parallel vs PyTorch's DTensor tensor parallel, gloo ranks on CPU (fp32).

One training step (forward, vocab-parallel cross-entropy, backward, AdamW, zero_grad) of the same dense
Llama model on the same batches, tensor parallel over the whole world (tp=2, then tp=4), with and
without sequence parallel: meshtron's `apply_tensor_parallel` against `parallelize_module` with
torchtitan's plan ("torch"), and with the same plan except that the column-parallel projections of a
block share one Replicate input DTensor, so backward reduces their summed input gradient once, as
meshtron does ("torch-shared"). The check steps are steps 1 and 2 (the second after one AdamW step, so
it also checks the gradients), each against the unsharded model on one device.
Method and analysis: benchmarks/RESULTS.md. E.g. `python benchmarks/tensor_parallel.py --tp 2 --out -`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import harness
import reporting
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Clock, Counter, Pair, Runner
from reporting import mib, ms, table
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.comm.collectives import Comm
from meshtron.comm.mesh import ParallelMesh
from meshtron.config.layout import ParallelDims
from meshtron.config.schema import ModelConfig
from meshtron.models.llama import Transformer, build_model
from meshtron.observe.metrics import state_bytes
from meshtron.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

TITLE = "## Tensor parallel: meshtron vs PyTorch DTensor TP (gloo, CPU)"
# kv_heads=4 is divisible by tp=4, so both sides split the key/value heads.
MODEL = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096)
SEQ, BATCH = 256, 4  # the batch is replicated over tp
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
PHASES = ("forward", "backward", "optimizer")  # forward includes the loss, optimizer zero_grad


def name(impl: str, tp: int, sp: bool) -> str:
    return f"{impl} tp={tp}{'+sp' if sp else ''}"


def pairs_of(tp: int, sps: Sequence[bool], peers: Sequence[str]) -> list[Pair]:
    return [Pair(name("meshtron", tp, sp), name(peer, tp, sp)) for sp in sps for peer in peers]


def batch_of(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return harness.token_batch(MODEL.vocab_size, BATCH, SEQ, seed, step)


# -- what runs on every rank --


def make_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The same AdamW everywhere (elementwise, so sharding cannot change the math); one foreach call cannot
    mix DTensors with the plain norm weights torch keeps without sp, so each kind gets its own group."""
    dtensors = [p for p in params if isinstance(p, DTensor)]
    groups = [{"params": g} for g in (dtensors, [p for p in params if not isinstance(p, DTensor)]) if g]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)


class TensorParallel(Runner):
    def __init__(self, name: str, model: Transformer, context: Callable[[], Any] = contextlib.nullcontext):
        self.name, self.model, self.context = name, model, context
        self.optimizer = make_optimizer(list(model.parameters()))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], clock: Clock) -> float:
        inputs, targets = batch
        with self.context():  # loss_parallel must cover backward too
            loss = self.loss(self.model(inputs), targets)
            clock.lap("forward")
            loss.backward()
            clock.lap("backward")
        self.optimizer.step()
        clock.lap("optimizer")
        clock.snapshot(self)  # before zero_grad, which frees the gradients
        self.optimizer.zero_grad()
        clock.lap("optimizer")
        return float(loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach())

    def snapshot(self) -> dict[str, Any]:
        return {"state": state_bytes(self.model.parameters(), self.optimizer)}


class Meshtron(TensorParallel):
    def __init__(self, seed: int, mesh: ParallelMesh, sp: bool):
        model, self.comm = build_model(MODEL, seed=seed), Comm()
        self.plan = apply_tensor_parallel(model, self.comm, mesh.group("tp"), sp)
        super().__init__(name("meshtron", mesh.dims.tp, sp), model)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.plan, self.comm).sum() / targets.numel()

    def counting(self) -> contextlib.AbstractContextManager[Counter | None]:
        return contextlib.nullcontext(harness.CommCounter(self.comm))


class TorchTP(TensorParallel):
    def __init__(self, seed: int, mesh: ParallelMesh, sp: bool, impl: str):
        model, tp_mesh = build_model(MODEL, seed=seed), mesh.mesh("tp")
        residual = Shard(1) if sp else Replicate()  # with sp the residual stream is sharded on the sequence
        shared = impl == "torch-shared"
        block_plan: dict[str, Any] = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        block_plan |= {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}
        block_plan |= {
            f"{m}.{w}": RowwiseParallel(output_layouts=residual)
            for m, w in (("attention", "wo"), ("feed_forward", "w2"))
        }
        if sp:
            block_plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        if sp or shared:  # torch-shared: the projections share one Replicate DTensor input
            # Attention takes (x, cos, sin, cache): only x is laid out.
            prepare = dict(desired_input_layouts=(Replicate(), None, None, None), use_local_output=not shared)
            block_plan["attention"] = PrepareModuleInput(
                input_layouts=(residual, None, None, None), **prepare
            )
            prepare["desired_input_layouts"] = (Replicate(),)
            block_plan["feed_forward"] = PrepareModuleInput(input_layouts=(residual,), **prepare)
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, block_plan)
        top_plan: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
            # Only shards the weight: Transformer.forward calls F.linear(h, output.weight), not output(h).
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        if sp:
            top_plan["norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, top_plan)
        # What ColwiseParallel would do to the head's input, on the norm's output instead: a Replicate
        # DTensor (all-gathered under sp), so F.linear with the Shard(0) weight gives Shard(-1) logits.
        to_head = PrepareModuleOutput(
            output_layouts=residual, desired_output_layouts=Replicate(), use_local_output=False
        )
        parallelize_module(model.norm, tp_mesh, to_head)
        super().__init__(name(impl, mesh.dims.tp, sp), model, loss_parallel)

    def counting(self) -> contextlib.AbstractContextManager[Counter | None]:
        return DTensorCounter(dist.get_world_size())

    def snapshot(self) -> dict[str, Any]:
        grad = self.model.tok_embeddings.weight.grad
        embedding = f"{', '.join(map(repr, grad.placements))}, local shape {tuple(grad.to_local().shape)}"
        return super().snapshot() | {"embedding_grad": embedding}


class DTensorCounter(Counter, TorchDispatchMode):
    """The functional collectives DTensor issues, seen on local tensors once DTensor has dispatched."""

    def __init__(self, world: int):
        Counter.__init__(self)
        TorchDispatchMode.__init__(self)
        self.world = world

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        op = func._opname if func.namespace == "_c10d_functional" else ""
        if op.startswith(("all_", "reduce", "broadcast")):  # not wait_tensor or autograd wrappers
            if op not in (
                "all_reduce",
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
                "all_to_all_single",
            ):
                raise NotImplementedError(f"uncounted collective {func}")
            nbytes = args[0].numel() * args[0].element_size()
            self.add(op, nbytes * (self.world if op == "all_gather_into_tensor" else 1), self.world)
        return func(*args, **(kwargs or {}))


def reference_losses(seed: int) -> list[float]:
    """Losses of steps 1 and 2 of the unsharded model on one device (one AdamW step in between)."""
    model = build_model(MODEL, seed=seed)
    inputs, targets = batch_of(seed, 0)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    make_optimizer(list(model.parameters())).step()
    inputs, targets = batch_of(seed, 1)
    with torch.no_grad():
        return [float(loss), float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))]


def bench_rank(
    seed: int, warmup: int, steps: int, sps: Sequence[bool], peers: Sequence[str], op_tables: bool
) -> harness.RankResult:
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    mesh = ParallelMesh(ParallelDims(tp=tp), "cpu")
    runners: list[Runner] = []
    for sp in sps:
        runners += [Meshtron(seed, mesh, sp), *(TorchTP(seed, mesh, sp, peer) for peer in peers)]
    return harness.run_rounds(
        runners,
        lambda step: batch_of(seed, step),
        pairs_of(tp, sps, peers),
        warmup,
        steps,
        check_steps=2,
        reference=reference_losses(seed),
        op_tables=op_tables,
    )


# -- what the parent makes of every world's results --


def tables(pairs: list[Pair], samples: dict[str, reporting.Samples]) -> list[list[str]]:
    runs = samples.values()
    rows = [
        [s.name, *s.timing(), s.state, mib(s.alloc_peak), f"{mib(s.comm()[1])} ({s.comm()[0]})"] for s in runs
    ]
    phase_rows = []
    for s in runs:
        calls, volume = zip(*(s.comm(p) for p in PHASES), strict=True)
        phase_rows.append([s.name, *(ms(s.phase(p)) for p in PHASES), " / ".join(map(str, calls))])
        phase_rows[-1].append(" / ".join(map(mib, volume)))
    return [
        reporting.comparison_table(pairs, samples),
        table(
            "implementation | median step ms | p10 ms | p90 ms | state MiB per rank (params / grads / optim) "
            "| peak step allocations MiB | comm MiB per step per rank (collectives)",
            rows,
            "Steps (the slowest rank's); state after the optimizer step (the largest rank's), peak "
            "allocations and per-rank ring volume, of the measured step:",
        ),
        table(
            "implementation | forward + loss ms | backward ms | optimizer + zero_grad ms "
            "| collectives forward / backward / optimizer | comm MiB forward / backward / optimizer",
            phase_rows,
            "Median ms per phase (mean over ranks), and the collectives of each phase in the measured step:",
        ),
        reporting.delta_table(pairs, samples, {p: [p] for p in PHASES}),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp degrees (one world each)")
    parser.add_argument(
        "--sp", choices=("both", "off", "on"), default="both", help="sequence parallel variants"
    )
    peers = ("torch", "torch-shared")
    parser.add_argument(
        "--torch", nargs="+", choices=peers, default=list(peers), help="torch plans to compare with"
    )
    args = parser.parse_args(argv)
    sps = {"both": (False, True), "off": (False,), "on": (True,)}[args.sp]
    report = reporting.Report(__file__, TITLE)
    for tp in args.tp:
        print(f"tp={tp}: {tp} gloo ranks; {args.warmup} warmup + {args.steps} timed steps")
        rank_args = (args.seed, args.warmup, args.steps, sps, args.torch, args.profile)
        report.add(harness.run_world(tp, bench_rank, *rank_args))
    report.blocks = tables(report.pairs, report.samples)
    cpus = os.cpu_count() or 1
    worlds = ", ".join(f"tp={t} {'oversubscribed' if t > cpus else 'one rank per core'}" for t in args.tp)
    n_params = sum(p.numel() for p in build_model(MODEL).parameters())
    torch_runs = [report.samples[name(args.torch[0], t, sps[0])] for t in args.tp]
    embedding = [
        f"tp={t}: {s.measured[0].notes['embedding_grad']}" for t, s in zip(args.tp, torch_runs, strict=True)
    ]
    report.facts = [
        f"every rank `torch.set_num_threads(1)`; {worlds} (an oversubscribed rank waits for the OS to schedule "
        "its peers at every collective, so absolute times are noisy)",
        f"model: {reporting.model_text(MODEL)}, seq {SEQ}, untied head, batch {BATCH} (replicated over tp); "
        f"{n_params / 1e6:.2f}M parameters, fp32, dense",
        f"{args.steps} timed steps per implementation after the 2 check steps and {args.warmup} warmup, plus one "
        "measured step",
        "torch's embedding gradient (measured step): " + "; ".join(embedding),
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
