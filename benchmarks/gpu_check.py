"""One GPU, one script: meshtron's single-device paths checked against the CPU, then timed and measured.

    python benchmarks/gpu_check.py                    # CUDA: every section into RESULTS.md, under 8 min
    python benchmarks/gpu_check.py --smoke --out -    # CPU, tiny shapes, fp32: what CI runs

It needs nothing beyond torch, transformers, safetensors, tokenizers and numpy, and no network (the
memory section trains on the byte-tokenized default corpus, prepared from Python's own library).

1. Correctness first. Every path a single GPU takes, on a small Llama (and its MoE twin), against the
   CPU fp32 reference on the same weights and batch: the reference is the eager model with attention as
   dense masked SDPA; the device runs the path under test in bf16 autocast over fp32 weights. Compared:
   the first loss (relative difference) and the gradients (relative L2 error of all of them together,
   and of the worst parameter). The bf16 tolerances are those of bf16 rounding through a few layers
   (8 mantissa bits: 2^-8 = 0.4% per rounding): loss 1e-2, all gradients 5e-2, worst parameter 1e-1; in
   the CPU smoke run (fp32 throughout) 1e-5, 1e-4, 1e-4. Generation compares the KV-cached logits of
   every new token with a full forward over the whole sequence (fp32, 1e-4), and the checkpoint the
   loss after a safetensors round trip (exactly equal).
2. The planner's compute terms: benchmarks/planner_terms.py times each kernel class the planner prices
   (GEMMs, grouped experts, attention core, MoE permutation, router) and meshtron's whole block at the
   published MoE runs' shapes against the planner's seconds for it (about a minute; its own section of
   RESULTS.md, written as it ends).
3. Speed: benchmarks/gpu_step.py's cases (the Llama-3.2-1B and 3B shapes and an MoE, eager and
   compiled, recompute on and off, against transformers on the same weights, MFU against the datasheet
   peak), within a time budget; its own section of RESULTS.md.
4. Memory: a few steps of `meshtron train`'s Trainer on the 1B shape per configuration, the peak of
   `torch.cuda.max_memory_allocated` against the planner's prediction for the same config on one GPU
   (plan/gpu_memory.py: parameters, gradients, optimizer, activations, transients; no CUDA context, no
   fragmentation: allocated, not reserved). The smoke run trains the tiny shape on the CPU and reports
   the prediction only (the CPU's measurement is benchmarks/memory_vs_plan.py's).
5. Operations: a short `Trainer.run` with profiled steps and an asynchronous checkpoint on the device:
   the trace (CUDA kernels included), the allocator's history, the peak per phase against the planner,
   the checkpoint published and loading back into the same loss (docs/operations.md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_step
import planner_terms
import torch
import torch.nn.functional as F
from reporting import RESULTS, table, write_section
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.hf import load, save
from meshtron.models.attention import Attention, document_causal_mask
from meshtron.models.blockwise_attention import attend_blockwise
from meshtron.models.llama import KVCache, build_model
from meshtron.parallel.compile import compile_blocks
from meshtron.parallel.recompute import apply_recompute
from meshtron.plan.gpu_memory import MemoryOverhead, stage_memory
from meshtron.rules.checks import load_config

TITLE = "## One GPU: acceptance checks (correctness against the CPU, memory against the planner)"
SMALL = ModelConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=8192)
TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
TOLERANCES = {torch.bfloat16: (1e-2, 5e-2, 1e-1), torch.float32: (1e-5, 1e-4, 1e-4)}  # loss, grads, worst


@dataclass(frozen=True)
class Setting:
    device: torch.device
    dtype: torch.dtype  # the autocast dtype on the device (fp32: none)
    dense: ModelConfig
    seq: int
    batch: int

    @property
    def moe(self) -> ModelConfig:
        return dataclasses.replace(self.dense, n_experts=8, top_k=2, moe_ffn_dim=self.dense.ffn_dim // 2)

    @property
    def windowed(self) -> ModelConfig:
        return dataclasses.replace(self.dense, sliding_window=self.seq // 4)


def dense_attention(model: nn.Module) -> None:
    """Every attention as SDPA with an explicit mask (causal, within documents, within the window):
    the reference, whatever path the device takes."""
    for module in model.modules():
        if isinstance(module, Attention):

            def attend(q, k, v, docs_BS=None, m=module):
                docs = (
                    docs_BS if docs_BS is not None else torch.zeros(q.shape[0], q.shape[2], dtype=torch.long)
                )
                mask = document_causal_mask(docs.to(q.device), m.sliding_window)
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
                )

            module.attend = attend


def blockwise_attention(model: nn.Module) -> None:
    """Every attention through the tiled blockwise path (context parallel's kernel, and one rank's
    document masks on the CPU), with the model's window."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = lambda q, k, v, docs_BS=None, m=module: attend_blockwise(
                q, k, v, docs_BS, m.sliding_window
            )


def batch_of(s: Setting, cfg: ModelConfig, documents: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [B, S+1] and, with `documents`, ids [B, S] of 5 documents of random lengths per sequence."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=generator)
    if not documents:
        return tokens, None
    starts = torch.zeros(s.batch, s.seq, dtype=torch.long)
    for row in starts:
        row[torch.randperm(s.seq - 1, generator=generator)[:4] + 1] = 1
    return tokens, torch.cumsum(starts, dim=1)


def loss_and_grads(
    model: nn.Module,
    tokens: torch.Tensor,
    docs: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = tokens.to(device)
    extra = {} if docs is None else {"docs_BS": docs.to(device)}
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits, aux = model(tokens[:, :-1], return_aux=True, **extra)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + aux
    loss.backward()
    return float(loss), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def compare(
    name: str, s: Setting, cfg: ModelConfig, prepare: Callable[[nn.Module], None], documents: bool
) -> list:
    """One row: the path `prepare` sets up, on the device, against the CPU fp32 dense reference."""
    reference = build_model(cfg, seed=0)
    candidate = copy.deepcopy(reference).to(s.device)
    dense_attention(reference)
    prepare(candidate)
    tokens, docs = batch_of(s, cfg, documents)
    want_loss, want = loss_and_grads(reference, tokens, docs, torch.device("cpu"), torch.float32)
    got_loss, got = loss_and_grads(candidate, tokens, docs, s.device, s.dtype)
    return compared(name, (want_loss, want), (got_loss, got), TOLERANCES[s.dtype])


def compared(name: str, want: tuple, got: tuple, tol: tuple[float, float, float]) -> list:
    """A table row: (loss, gradients) of the candidate against the reference's, within `tol` (loss,
    all gradients, worst parameter: relative)."""
    (want_loss, want_grads), (got_loss, got_grads) = want, got
    errors = {n: float((got_grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in want_grads.items()}
    total = math.sqrt(sum(float((got_grads[n] - g).norm()) ** 2 for n, g in want_grads.items()))
    total /= math.sqrt(sum(float(g.norm()) ** 2 for g in want_grads.values()))
    worst = max(errors, key=errors.get)
    loss_error = abs(got_loss - want_loss) / abs(want_loss)
    ok = loss_error <= tol[0] and total <= tol[1] and errors[worst] <= tol[2]
    return [name, f"{want_loss:.5f}", f"{got_loss:.5f}", f"{loss_error:.1e}", f"{total:.1e}",
            f"{errors[worst]:.1e} ({worst})", "ok" if ok else "OVER"]  # fmt: skip


def generate_row(s: Setting) -> list:
    """Logits of 8 new tokens through the KV cache against a full forward of the whole sequence (fp32)."""
    model = build_model(s.dense, seed=0).to(s.device).eval()
    tokens, _ = batch_of(s, s.dense, False)
    tokens = tokens[:, : s.seq // 2].to(s.device)
    with torch.no_grad():
        cache = KVCache(s.dense, tokens.shape[0], tokens.shape[1] + 8, s.device, torch.float32)
        logits, worst = model(tokens, cache=cache)[:, -1], 0.0
        for _ in range(8):
            full = model(tokens)[:, -1]
            worst = max(worst, float((logits - full).abs().max() / full.abs().max()))
            token = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            logits = model(token, cache=cache)[:, -1]
    return ["generate: KV cache vs full forward (fp32, 8 tokens)", "", "", f"{worst:.1e}", "", "",
            "ok" if worst <= 1e-4 else "OVER"]  # fmt: skip


def checkpoint_row(s: Setting) -> list:
    """The loss before and after a safetensors save and load (meshtron.hf) on the device: equal."""
    model = build_model(s.dense, seed=0).to(s.device)
    tokens, _ = batch_of(s, s.dense, False)
    before, _ = loss_and_grads(model, tokens, None, s.device, s.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        save(model, tmp)
        loaded = load(tmp).to(s.device)
    after, _ = loss_and_grads(loaded, tokens, None, s.device, s.dtype)
    return ["checkpoint: safetensors save and load", f"{before:.5f}", f"{after:.5f}",
            f"{abs(after - before):.1e}", "", "", "ok" if after == before else "OVER"]  # fmt: skip


def float8_row(s: Setting, recipe: str) -> list:
    """Float8 projections (parallel/float8.py) on the device (torch._scaled_mm on CUDA) against the same
    model's float8 arithmetic emulated on the CPU, both under bf16 autocast: the casts and scales agree,
    so what differs is the accumulation order and bf16 rounding (tolerances: loss 1e-2, all gradients
    5e-2, the worst parameter 1e-1)."""
    from meshtron.comm.collectives import Comm
    from meshtron.parallel.float8 import apply_float8

    reference = build_model(s.dense, seed=0)
    candidate = copy.deepcopy(reference).to(s.device)
    for model in (reference, candidate):
        apply_float8(model, recipe, Comm(), None)
    tokens, _ = batch_of(s, s.dense, False)
    want = loss_and_grads(reference, tokens, None, torch.device("cpu"), torch.bfloat16)
    got = loss_and_grads(candidate, tokens, None, s.device, torch.bfloat16)
    name = f"float8 projections ({recipe}) vs the CPU's emulation, bf16"
    return compared(name, want, got, TOLERANCES[torch.bfloat16])


def pair_lane_row(s: Setting) -> list:
    """DualPipeV's pair lane on one device (pipeline/pairs.py): one model's forward in the helper thread
    (on CUDA on its own stream, its saved tensors marked for the main stream) while another model's
    backward runs here, then the first one's backward: the losses and gradients of both equal the same
    work done one after the other. What needs two GPUs (NCCL across ranks) is not checked here."""
    from meshtron.comm.collectives import Comm
    from meshtron.pipeline.pairs import run_pair

    tokens, _ = batch_of(s, s.dense, False)
    batches = (tokens, tokens.roll(1, dims=0))
    serial = [build_model(s.dense, seed=seed).to(s.device) for seed in (0, 1)]
    paired = [copy.deepcopy(m) for m in serial]

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(s.device)
        with torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype != torch.float32):
            logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    want = [loss(m, b) for m, b in zip(serial, batches, strict=True)]
    for value in reversed(want):
        value.backward()
    waiting = loss(paired[1], batches[1])  # the pair's backward is an earlier micro-batch's
    got: dict = {}

    def forward() -> None:
        got["stream"] = torch.cuda.current_stream(s.device) if s.device.type == "cuda" else None
        got["loss"] = loss(paired[0], batches[0])

    run_pair(Comm(), forward, waiting.backward, s.device)
    got["loss"].backward()
    errors = [abs(float(got["loss"]) - float(want[0])) / abs(float(want[0]))]
    for ours, theirs in zip(paired, serial, strict=True):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            errors.append(float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)))
    own_stream = s.device.type != "cuda" or got["stream"] != torch.cuda.current_stream(s.device)
    worst = max(errors)
    where = "its own stream" if s.device.type == "cuda" else "CPU: no streams"
    return [f"DualPipeV pair lane: forward in a thread ({where}) while a backward runs", "", "",
            f"{errors[0]:.1e}", f"{worst:.1e}", "", "ok" if worst <= 1e-5 and own_stream else "OVER"]  # fmt: skip


def correctness(s: Setting) -> tuple[list[str], bool]:
    def recompute(mode: str) -> Callable[[nn.Module], None]:
        return lambda m: apply_recompute(m, mode)

    checks = [
        ("attention: SDPA, causal", s.dense, lambda m: None, False),
        ("attention: default path (CUDA: SDPA), documents + window", s.windowed, lambda m: None, True),
        ("attention: blockwise (CUDA: tiled), documents + window", s.windowed, blockwise_attention, True),
        ("MoE: grouped GEMM (8 experts, top-2)", s.moe, lambda m: None, False),
        ("compile: every block", s.dense, compile_blocks, False),
        ("recompute: full", s.dense, recompute("full"), False),
        ("recompute: selective", s.dense, recompute("selective"), False),
        (
            "MoE compiled, selective recompute",
            s.moe,
            lambda m: (compile_blocks(m), apply_recompute(m, "selective")),
            False,
        ),
    ]
    rows = []
    for name, cfg, prepare, documents in checks:
        rows.append(compare(name, s, cfg, prepare, documents))
        print(" | ".join(rows[-1]), flush=True)
    rows += [float8_row(s, recipe) for recipe in ("tensorwise", "rowwise")]
    rows += [generate_row(s), checkpoint_row(s), pair_lane_row(s)]
    header = ("check | CPU fp32 loss | device loss | loss rel. diff | gradients rel. L2 | worst parameter "
              "| within tolerance")  # fmt: skip
    return table(header, rows), all(r[-1] == "ok" for r in rows)


MEMORY = {  # name: overrides of the 1B shape's training config
    "eager": [],
    "selective recompute": ["--training.recompute=selective"],
    "full recompute": ["--training.recompute=full"],
    "compiled": ["--training.compile=true"],
}


def memory(s: Setting, smoke: bool, run_dir: str) -> list[str]:
    from meshtron.train.trainer import Trainer

    base = ["--model.name=llama3-1b", "--training.seq_len=2048", "--training.global_batch=4",
            "--training.micro_batch=4", "--training.dtype=bf16"]  # fmt: skip
    if smoke:  # the tiny shape, eager only (the correctness section compiled it already)
        base = [f"--model.{k}={getattr(TINY, k)}" for k in SHAPE_KEYS]
        base += ["--training.seq_len=32", "--training.global_batch=2", "--training.micro_batch=2"]
    common = ["--data.tokenizer=byte", "--run.plot=false", "--run.sample_tokens=0", "--training.steps=3",
              f"--run.dir={run_dir}", f"--run.device={s.device.type}"]  # fmt: skip
    rows = []
    for name, overrides in MEMORY.items():
        if smoke and "--training.compile=true" in overrides:
            continue
        cfg = load_config(None, [*base, *common, *overrides])
        parts = stage_memory(cfg, 1, 0, None, MemoryOverhead(context_bytes=0.0, fragmentation=0.0))
        predicted = sum(v for k, v in parts.items() if k != "reserved")
        trainer = Trainer(cfg)
        if s.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(s.device)
        for step in range(cfg.training.steps):
            trainer.step(step)
        measured = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else math.nan
        trainer.close()
        del trainer
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
        ratio = "" if math.isnan(measured) else f"{measured / predicted:.2f}"
        shown = "" if math.isnan(measured) else f"{measured / 2**20:,.0f}"
        split = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in parts.items() if k != "reserved" and v)
        rows.append([name, shown, f"{predicted / 2**20:,.0f}", ratio, split])
        print(" | ".join(rows[-1]), flush=True)
    header = (
        "configuration | measured peak MiB | predicted MiB | measured / predicted | predicted parts (MiB)"
    )
    return table(header, rows)


def operations(s: Setting, run_dir: str) -> tuple[list[str], bool]:
    """A 3-step run of the tiny model on the device, steps 2-3 profiled, checkpoints written in the
    background: what it left, and whether the checkpoint reproduces the run's last weights."""
    import json

    from meshtron.checkpoint.save_load import complete_checkpoints, load_model_weights
    from meshtron.train.trainer import Trainer

    shape = [f"--model.{k}={getattr(TINY, k)}" for k in SHAPE_KEYS]
    cfg = load_config(None, [*shape, "--data.tokenizer=byte", "--training.seq_len=32", "--training.global_batch=2",
                             "--training.micro_batch=2", "--training.steps=3", "--run.plot=false",
                             "--run.sample_tokens=0", f"--run.dir={run_dir}", f"--run.device={s.device.type}",
                             "--profile.steps=[2, 3]", "--checkpoint.every=3", "--checkpoint.async=true"])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.run()
    model = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()}
    trainer.close()
    traces = Path(run_dir) / "traces"
    trace = json.loads((traces / "rank-00000.json").read_text())["traceEvents"]
    names = {e.get("name") for e in trace}
    kernels = sum(e.get("cat") == "kernel" for e in trace)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    measured, planner = summary["memory_by_phase"][0]["measured"], summary["memory_by_phase"][0]["planner"]
    saved = complete_checkpoints(Path(run_dir) / "checkpoints")
    copy_ = build_model(TINY)
    load_model_weights(saved[-1].path, copy_)
    same = all(torch.equal(model[n], p) for n, p in copy_.named_parameters())
    cuda = s.device.type == "cuda"
    checks = {  # None: does not apply on this device
        "trace with meshtron's spans": {"forward micro-batch 0", "optimizer", "step 3"} <= names,
        "CUDA kernels in the trace": kernels > 0 if cuda else None,
        "allocator history": (traces / "memory-rank-00000.pickle").is_file() if cuda else None,
        "memory per phase": measured.get("peak", 0) > 0,
        "async checkpoint published, equal to the run's weights": [c.step for c in saved] == [3] and same,
    }
    shown = {True: "ok", False: "FAILED", None: "n/a on the CPU"}
    rows = [f"- {name}: {shown[ok]}" for name, ok in checks.items()]
    rows.append(
        f"- peak {measured.get('peak', 0) / 2**20:,.1f} MiB measured ({', '.join(f'{k} {measured[k] / 2**20:,.1f}' for k in ('forward', 'backward', 'optimizer') if k in measured)}); "
        f"planner {planner['total'] / 2**20:,.1f} MiB; checkpoint stall {summary['checkpoint_stall_s']['median']:.3f} s"
    )
    print("\n".join(rows), flush=True)
    return rows, all(ok is not False for ok in checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32 (CI's run)")
    parser.add_argument("--speed-budget-s", type=float, default=180.0, help="gpu_step's time budget")
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU path")
    started = time.perf_counter()
    if args.smoke:
        setting = Setting(torch.device("cpu"), torch.float32, TINY, 32, 2)
    else:
        setting = Setting(torch.device("cuda"), torch.bfloat16, SMALL, 512, 2)
    rows, ok = correctness(setting)
    # The planner's terms before the speed table: the shorter run, and the figures the planner waits on.
    # Each writes its own section of the results file as it ends, so a run cut short keeps them.
    terms_failed = planner_terms.main([*(["--smoke"] if args.smoke else []), "--out", args.out])
    speed = ["--smoke"] if args.smoke else ["--budget-s", str(args.speed_budget_s)]
    speed_failed = gpu_step.main([*speed, "--out", args.out])
    with tempfile.TemporaryDirectory() as tmp:
        memory_rows = memory(setting, args.smoke, tmp)
    with tempfile.TemporaryDirectory() as tmp:
        operation_rows, operations_ok = operations(setting, tmp)
    name = torch.cuda.get_device_name(setting.device) if setting.device.type == "cuda" else "CPU (smoke)"
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {name}; torch {torch.__version__}; took "
        f"{time.perf_counter() - started:.0f} s",
        f"correctness: {'every check within tolerance' if ok else 'SOME CHECKS OVER TOLERANCE'}; model "
        f"dim {setting.dense.dim}, {setting.dense.n_layers} layers, seq {setting.seq}, batch {setting.batch}, "
        f"device dtype {str(setting.dtype).removeprefix('torch.')}",
        "speed: the section of benchmarks/gpu_step.py, and the planner's terms that of "
        "benchmarks/planner_terms.py (both written by this run)",
        f"reproduce: `python benchmarks/gpu_check.py{' --smoke' if args.smoke else ''}`",
    ]
    body = "\n".join(
        ["\n".join(f"- {f}" for f in facts), "", *rows, "", "Memory: peak allocated over 3 training steps "
         "against the planner's prediction for the same config on one GPU:", "", *memory_rows, "",
         "Operations (docs/operations.md), the tiny model, 3 steps:", "", *operation_rows]
    )  # fmt: skip
    print(body)
    if args.out != "-":
        write_section(Path(args.out), TITLE, "gpu_check.py", body + "\n")
    return 0 if ok and operations_ok and not speed_failed and not terms_failed else 1


if __name__ == "__main__":
    sys.exit(main())
