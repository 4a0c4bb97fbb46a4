"""Benchmark: one GPU, bf16: meshtron's model against transformers' on the same weights, eager and compiled.

A training step (forward under bf16 autocast over fp32 weights, cross-entropy outside both models,
backward, fused AdamW, zero_grad) of a Llama-3.2-1B-shaped and a 3B-shaped model and an MoE of about
the 1B's active size (Mixtral architecture, 8 experts, top-2), each built by meshtron and handed to
transformers' model class (`LlamaForCausalLM`, `MixtralForCausalLM`, SDPA attention) through
`meshtron.hf.weights.hf_state_dict`. Before anything is timed, both give the first batch's loss and
must agree (bf16: 2e-2 relative; fp32: 1e-5). Each case reports tokens/s, MFU (model FLOPs of
plan/flops.py, recompute not counted, against the GPU's datasheet dense bf16 peak) and peak memory.
Compiled: every transformer block `torch.compile`d (meshtron: `compile_blocks`, what
`training.compile = true` does; transformers: each decoder layer), as torchtitan compiles.

Cases run in priority order until `--budget-s` is spent (the rest are listed as skipped): the 1B shape
eager and compiled, with and without full recompute, then the 3B and the MoE.

    python benchmarks/gpu_step.py                      # on a CUDA GPU: the table goes to RESULTS.md
    python benchmarks/gpu_step.py --smoke --out -      # CPU, tiny shapes, fp32 (CI: through gpu_check.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from reporting import RESULTS, table, write_section
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.config.presets import PRESETS
from meshtron.config.schema import ModelConfig
from meshtron.hf import save
from meshtron.hf.weights import hf_state_dict
from meshtron.models.llama import build_model
from meshtron.parallel.compile import compile_blocks
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.recompute import apply_recompute
from meshtron.plan.flops import training_flops_per_token
from meshtron.probe.peak import peak_flops

TITLE = "## One GPU: meshtron vs transformers (bf16)"
LLAMA_1B = ModelConfig(**PRESETS["llama3-1b"])
SHAPES = {
    "llama-1b": (LLAMA_1B, 2048, 4),  # (model, sequence length, sequences per step)
    "llama-3b": (
        dataclasses.replace(LLAMA_1B, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
        2048,
        2,
    ),
    "moe-8x1b": (dataclasses.replace(LLAMA_1B, n_experts=8, top_k=2, moe_ffn_dim=4096), 2048, 4),
}
TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
SMOKE = {
    "tiny": (TINY, 32, 2),
    "tiny-moe": (dataclasses.replace(TINY, n_experts=4, top_k=2, moe_ffn_dim=64), 32, 2),
}


@dataclass(frozen=True)
class Case:
    shape: str
    impl: str  # "meshtron" or "transformers"
    compiled: bool
    recompute: bool
    fp8: bool = False  # meshtron's float8 projections (training.dtype = "fp8"; parallel/float8.py)

    @property
    def label(self) -> str:
        extra = f"{' compiled' if self.compiled else ''}{' recompute' if self.recompute else ''}"
        return f"{self.shape} {self.impl}{extra}{' fp8' if self.fp8 else ''}"


@dataclass
class Outcome:
    case: Case
    first_loss: float
    step_s: list[float]
    tokens: int
    flops_per_token: float
    peak_bytes: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.step_s)


def cases(shapes: list[str], compile_too: bool) -> list[Case]:
    """In priority order: the first shape in every variant, then the others eager (and compiled)."""
    out = []
    for i, shape in enumerate(shapes):
        variants = (
            [(False, False), (True, False), (False, True), (True, True)]
            if i == 0
            else [(False, False), (True, False)]
        )
        for compiled, recompute in variants:
            if compiled and not compile_too:
                continue
            out += [Case(shape, impl, compiled, recompute) for impl in ("meshtron", "transformers")]
        if i == 0:  # float8 (meshtron only: transformers has none without torchao), eager and compiled
            out += [Case(shape, "meshtron", compiled, False, fp8=True) for compiled in (False, compile_too)]
    return list(dict.fromkeys(out))


def transformers_model(cfg: ModelConfig, ours: nn.Module) -> nn.Module:
    """transformers' model class for `cfg`, holding `ours`' weights: the state dict in memory for dense
    models; MoE checkpoints go through `from_pretrained`, whose converters fuse the per-expert tensors
    into transformers' expert layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.is_moe:
        with tempfile.TemporaryDirectory() as tmp:
            save(ours, tmp)
            return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    config, tensors = hf_state_dict(ours)
    hf_cfg = AutoConfig.for_model(**config)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):  # no random init of weights about to be replaced
        theirs = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = theirs.load_state_dict(tensors, strict=False, assign=True)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        raise SystemExit(
            f"weights do not map onto transformers' model: missing {missing}, unexpected {unexpected}"
        )
    if cfg.tie_embeddings:
        theirs.tie_weights()
    rotary = theirs.model.rotary_emb  # its inverse frequencies are computed, not loaded: make them for real
    theirs.model.rotary_emb = type(rotary)(config=hf_cfg)
    meta = [name for name, t in [*theirs.named_parameters(), *theirs.named_buffers()] if t.is_meta]
    if meta:
        raise SystemExit(f"left on the meta device: {meta}")
    return theirs


def prepare(case: Case, cfg: ModelConfig, device: torch.device) -> tuple[nn.Module, Callable]:
    """The model of the case on `device`, and its logits function."""
    ours = build_model(cfg, seed=0)
    if case.impl == "meshtron":
        model = ours.to(device)
        if case.fp8:
            apply_float8(model, "tensorwise", Comm(), None)
        if case.compiled:  # before recompute, as parallelize orders them: the checkpoint wraps it
            compile_blocks(model)
        if case.recompute:
            apply_recompute(model, "full")
        return model, model
    theirs = transformers_model(cfg, ours)
    del ours
    theirs = theirs.to(device)
    if case.recompute:
        theirs.config.use_cache = False
        theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case.compiled:
        for layer in theirs.model.layers:
            layer.compile()
    return theirs, lambda tokens: theirs(input_ids=tokens).logits


def run_case(
    case: Case, shape: tuple[ModelConfig, int, int], device: torch.device, dtype: torch.dtype, steps: int
) -> Outcome:
    cfg, seq, batch = shape
    model, logits_of = prepare(case, cfg, device)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> float:
        with autocast:
            logits = logits_of(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = step()  # also compiles
    step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return Outcome(case, first, times, batch * seq, training_flops_per_token(cfg, seq), peak)


def rows(outcomes: list[Outcome], peak: float) -> list[list[str]]:
    theirs = {  # float8 runs against transformers' bf16 run of the same shape and compilation
        (o.case.shape, o.case.compiled, o.case.recompute): o
        for o in outcomes
        if o.case.impl == "transformers"
    }
    out = []
    for o in outcomes:
        peer = theirs.get((o.case.shape, o.case.compiled, o.case.recompute))
        ratio = f"{o.tokens_per_s / peer.tokens_per_s:.2f}" if peer and o.case.impl == "meshtron" else ""
        mfu = o.tokens_per_s * o.flops_per_token / peak
        memory = "" if o.peak_bytes != o.peak_bytes else f"{o.peak_bytes / 2**30:.1f}"
        out.append([
            o.case.shape, o.case.impl + (" fp8" if o.case.fp8 else ""), "yes" if o.case.compiled else "no",
            "full" if o.case.recompute else "none",
            f"{1e3 * statistics.median(o.step_s):.1f}", f"{o.tokens_per_s:,.0f}", f"{100 * mfu:.1f}%", memory,
            f"{o.first_loss:.5f}", ratio,
        ])  # fmt: skip
    return out


def parity(outcomes: list[Outcome], rtol: float) -> list[str]:
    """Cases whose first loss differs from the other implementation's on the same shape by more than rtol."""
    first: dict[str, list[float]] = {}
    for o in outcomes:  # float8 rounds differently: its runs are compared among themselves
        first.setdefault(o.case.shape + (" fp8" if o.case.fp8 else ""), []).append(o.first_loss)
    return [s for s, losses in first.items() if max(losses) - min(losses) > rtol * abs(min(losses))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting cases after this")
    parser.add_argument("--no-compile", action="store_true", help="eager cases only")
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU path")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE if args.smoke else SHAPES
    todo = cases(list(shapes), compile_too=not args.no_compile and not args.smoke)
    started, outcomes, skipped = time.perf_counter(), [], []
    for case in todo:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(case.label)
            continue
        outcomes.append(
            run_case(case, shapes[case.shape], device, dtype, args.steps if not args.smoke else 2)
        )
        gc.collect()  # the case's model and optimizer, before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{case.label}: {outcomes[-1].tokens_per_s:,.0f} tokens/s", flush=True)
    peak, source = peak_flops(device, dtype)
    failed = parity(outcomes, 1e-5 if dtype == torch.float32 else 2e-2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {name}; torch {torch.__version__}; took {time.perf_counter() - started:.0f} s",
        f"MFU reference: {source}",
        f"parity of the first loss: {'FAILED for ' + ', '.join(failed) if failed else 'ok for every shape'}",
        f"skipped (over the {args.budget_s:.0f} s budget): {', '.join(skipped) or 'none'}",
        f"reproduce: `python benchmarks/gpu_step.py{' --smoke' if args.smoke else ''}`",
    ]
    header = (
        "shape | implementation | compiled | recompute | step ms (median) | tokens/s | MFU | peak memory GiB "
        "| first loss | meshtron / transformers tokens/s"
    )
    body = "\n".join(f"- {f}" for f in facts) + "\n\n" + "\n".join(table(header, rows(outcomes, peak))) + "\n"
    print(body)
    if args.out != "-":
        write_section(Path(args.out), TITLE, "gpu_step.py", body)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
