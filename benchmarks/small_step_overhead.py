"""Benchmark: meshtron's per-step overhead at nanoGPT's CPU size, against a minimal single-file loop.

nanoGPT's CPU recipe (4 layers, dim 128, 4 heads, 64-token context, batch 12; about 0.8M parameters)
on a byte-tokenized English text (docstrings of Python's standard library, about 1 MB, made here), with
the same kernels on both sides: `MiniLlama` below is meshtron's Llama written out in a few lines
(RMSNorm, RoPE, SwiGLU, SDPA, untied head), trained by a plain loop (the same batches as meshtron's
sampler, AdamW with decay on matrices, the same learning-rate schedule, torch's clip_grad_norm_).
  1. parity first: both take the check steps from the same weights (the loop loads meshtron's) on the
     same batches; their losses must agree to RTOL, or nothing is timed;
  2. per step, in one process: `Trainer.step` and the loop's step alternate, one each per round;
  3. whole process: `meshtron train` and `python benchmarks/small_step_overhead.py --minimal` (which
     imports torch and numpy only) alternate as subprocesses of `--process-steps` steps each.
Method and results: benchmarks/RESULTS.md. E.g. `python benchmarks/small_step_overhead.py --steps 200`.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TITLE = "## Per-step overhead at nanoGPT's CPU size: meshtron vs a minimal loop"
SHAPE = dict(dim=128, n_layers=4, n_heads=4, ffn_dim=344, vocab=257, seq=64, batch=12)
LR, WARMUP, MIN_LR_RATIO, WEIGHT_DECAY, BETAS, CLIP, EPS = 1e-3, 100, 0.1, 0.1, (0.9, 0.95), 1.0, 1e-5


# -- the minimal loop (torch and numpy only) --


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w2, self.w3 = (
            nn.Linear(d, ffn, bias=False),
            nn.Linear(ffn, d, bias=False),
            nn.Linear(d, ffn, bias=False),
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        h = rms_norm(x, self.attention_norm)
        q, k, v = (w(h).view(B, S, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(B, S, D))
        h = rms_norm(x, self.ffn_norm)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MiniLlama(nn.Module):
    def __init__(self, s: dict[str, int]):
        super().__init__()
        d = s["dim"]
        self.embed = nn.Embedding(s["vocab"], d)
        self.blocks = nn.ModuleList(Block(d, s["n_heads"], s["ffn_dim"]) for _ in range(s["n_layers"]))
        self.norm, self.head = nn.Parameter(torch.ones(d)), nn.Linear(d, s["vocab"], bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d // s["n_heads"], 2).float() / (d // s["n_heads"])))
        angles = torch.arange(s["seq"]).float()[:, None] * inv_freq
        self.cos, self.sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(rms_norm(x, self.norm))


def batches(data: Path, seq: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """meshtron's sampler written out: windows of seq+1 tokens, each epoch in the permutation of
    default_rng([seed, epoch]), `batch` windows a step."""
    tokens = np.memmap(data / "tokens.bin", dtype=np.uint16, mode="r")
    windows, perms = len(tokens) // (seq + 1), {}
    for step in itertools.count():
        epochs, offsets = np.divmod(np.arange(step * batch, (step + 1) * batch), windows)
        for e in set(epochs.tolist()) - set(perms):
            perms[e] = np.random.default_rng([seed, e]).permutation(windows)
        chosen = np.array([perms[e][o] for e, o in zip(epochs.tolist(), offsets, strict=True)])
        block = np.asarray(tokens[chosen[:, None] * (seq + 1) + np.arange(seq + 1)], dtype=np.int64)
        yield torch.from_numpy(block[:, :-1].copy()), torch.from_numpy(block[:, 1:].copy())


class MinimalLoop:
    def __init__(self, data: Path, steps: int, seed: int = 0):
        torch.manual_seed(seed)
        self.model, self.steps = MiniLlama(SHAPE), steps
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=1e-8, foreach=True)
        self.data = batches(data, SHAPE["seq"], SHAPE["batch"], seed)

    def lr(self, step: int) -> float:
        if step < WARMUP:
            return LR * (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, self.steps - WARMUP - 1))
        return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(self, step: int) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(step)
        inputs, targets = next(self.data)
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def minimal_main(data: Path, steps: int) -> None:
    """The loop as a process of its own: one JSON line of its step times and losses."""
    loop, times, losses = MinimalLoop(data, steps), [], []
    for i in range(steps):
        start = time.perf_counter()
        losses.append(loop.step(i))
        times.append(time.perf_counter() - start)
        if i % 10 == 0:  # a console line every 10 steps, as meshtron's run.log_every below
            print(f"step {i + 1}: loss {losses[-1]:.4f} {1e3 * times[-1]:.1f} ms", flush=True)
    print(json.dumps({"step_s": times, "losses": losses}))


# -- the parent: data, parity, alternating timings, the report --


def corpus(root: Path) -> Path:
    """About 1 MB of English (the docstrings of Python's standard library, in file order) prepared as
    bytes, once: a stand-in for tinyshakespeare that needs no network."""
    from meshtron.data.dataset import prepare_data

    out = root / "stdlib-docstrings-byte"
    if (out / "meta.json").exists():
        return out
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size > 1_000_000 or "test" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and (
                doc := ast.get_docstring(node)
            ):
                texts.append(doc)
                size += len(doc) + 2
    text = root / "stdlib-docstrings.txt"
    root.mkdir(parents=True, exist_ok=True)
    text.write_text("\n\n".join(texts))
    prepare_data([text], out, "byte", progress=False)
    return out


def overrides(data: Path, steps: int, run_dir: Path) -> list[str]:
    s = SHAPE
    return [
        f"--model.dim={s['dim']}", f"--model.n_layers={s['n_layers']}", f"--model.n_heads={s['n_heads']}",
        f"--model.n_kv_heads={s['n_heads']}", f"--model.ffn_dim={s['ffn_dim']}", f"--model.vocab_size={s['vocab']}",
        f"--model.norm_eps={EPS}", f"--training.seq_len={s['seq']}", f"--training.global_batch={s['batch']}",
        f"--training.micro_batch={s['batch']}", f"--training.steps={steps}", f"--training.lr={LR}",
        f"--training.warmup_steps={WARMUP}", f"--training.min_lr_ratio={MIN_LR_RATIO}",
        f"--training.weight_decay={WEIGHT_DECAY}", f"--training.beta1={BETAS[0]}", f"--training.beta2={BETAS[1]}",
        f"--training.grad_clip={CLIP}", f"--data.path={data}", "--data.tokenizer=byte", f"--run.dir={run_dir}",
        "--run.log_every=10", "--checkpoint.every=0", "--run.plot=false", "--run.sample_tokens=0",
    ]  # fmt: skip


def load_meshtron_weights(loop: MinimalLoop, state: dict[str, torch.Tensor]) -> None:
    """The loop's model takes meshtron's initial weights (its own names for the same tensors)."""
    names = {"embed.weight": "tok_embeddings.weight", "norm": "norm.weight", "head.weight": "output.weight"}
    for i in range(SHAPE["n_layers"]):
        b, m = f"blocks.{i}.", f"layers.{i}."
        names |= {b + n: m + f"{n}.weight" for n in ("attention_norm", "ffn_norm")}
        names |= {b + f"{w}.weight": m + f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        names |= {b + f"{w}.weight": m + f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    with torch.no_grad():
        for name, p in loop.model.named_parameters():
            p.copy_(state[names[name]])


def in_process(data: Path, tmp: Path, args: argparse.Namespace) -> tuple[list, list, dict[str, list[float]]]:
    """Check steps, then warm-up and timed rounds, both in this process, alternating step by step."""
    from meshtron.rules.checks import load_config
    from meshtron.train.trainer import Trainer

    total = args.check_steps + args.warmup + args.steps
    trainer = Trainer(load_config(None, overrides(data, total, tmp / "in-process")))
    loop = MinimalLoop(data, total, args.seed)
    load_meshtron_weights(loop, trainer.model.state_dict())
    ours, peer, times = [], [], {"meshtron": [], "minimal loop": []}
    names = list(times)
    for i in range(total):
        for name in names if i % 2 == 0 else names[::-1]:  # who goes first alternates
            start = time.perf_counter()
            loss = trainer.step(i)["loss"] if name == "meshtron" else loop.step(i)
            times[name].append(time.perf_counter() - start)
            (ours if name == "meshtron" else peer).append(loss)
        if i + 1 == args.check_steps and not all(
            abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, peer, strict=True)
        ):
            sys.exit(f"parity check failed: meshtron {ours} vs the minimal loop {peer}; nothing timed")
    trainer.close()
    first = args.check_steps + args.warmup
    return ours, peer, {k: v[first:] for k, v in times.items()}


def whole_process(data: Path, tmp: Path, steps: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, median step seconds) of each process, meshtron's and the loop's alternating."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    out: dict[str, list[tuple[float, float]]] = {"meshtron": [], "minimal loop": []}
    (config := tmp / "overhead.toml").write_text("# every key is an override (small_step_overhead.py)\n")
    for r in range(rounds):
        run_dir = tmp / f"process-{r}"
        commands = {
            "meshtron": [
                sys.executable,
                "-m",
                "meshtron",
                "train",
                "--config",
                str(config),
                *overrides(data, steps, run_dir),
            ],
            "minimal loop": [sys.executable, __file__, "--minimal", str(data), "--process-steps", str(steps)],
        }
        for name in list(commands) if r % 2 == 0 else list(commands)[::-1]:
            start = time.perf_counter()
            done = subprocess.run(commands[name], env=env, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - start
            if name == "meshtron":
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                step = statistics.median(row["step_time_s"] for row in rows)
            else:
                step = statistics.median(json.loads(done.stdout.splitlines()[-1])["step_s"])
            out[name].append((wall, step))
            print(f"  process {r} {name}: {wall:.2f} s, median step {1e3 * step:.1f} ms", flush=True)
    return out


def report(
    rep: Any,
    args: argparse.Namespace,
    argv: list[str],
    data: Path,
    checks: tuple,
    steps: dict,
    processes: dict,
) -> None:
    """`rep` (a reporting.Report, made at the start so that it times the run) gets the facts and tables."""
    import reporting
    from harness import Pair
    from reporting import Ratio, Samples, ms, table

    ours, peer = checks
    params = sum(p.numel() for p in MiniLlama(SHAPE).parameters())
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, peer, strict=True))
    rep.facts += [
        f"model: dim {SHAPE['dim']}, {SHAPE['n_layers']} layers, {SHAPE['n_heads']} heads, ffn {SHAPE['ffn_dim']}, "
        f"vocab {SHAPE['vocab']} (bytes); {params / 1e6:.2f}M parameters; batch {SHAPE['batch']} x seq {SHAPE['seq']}; "
        f"fp32, {torch.get_num_threads()} thread(s)",
        f"data: {(data / 'tokens.bin').stat().st_size // 2:,} byte tokens (Python's stdlib docstrings)",
        f"parity: {args.check_steps} check steps, then every step: first losses meshtron {ours[0]:.6f} / loop "
        f"{peer[0]:.6f}; worst relative difference over {len(ours)} steps {worst:.1e}",
        f"in one process: {args.steps} timed steps each after {args.check_steps} check and {args.warmup} warm-up; "
        f"whole process: {args.rounds} rounds of {args.process_steps} steps",
    ]
    samples = {n: Samples(n, v, {}, [0.0] * len(v), [], []) for n, v in steps.items()}
    pair = Pair("meshtron", "minimal loop")
    rep.blocks.append(reporting.comparison_table([pair], samples))
    if processes:  # (--rounds 0: none)
        walls = {n: [w for w, _ in v] for n, v in processes.items()}
        per = [a / b for a, b in zip(walls["meshtron"], walls["minimal loop"], strict=True)]
        rows = [[n, f"{statistics.median(walls[n]):.2f}", ms(statistics.median(s for _, s in processes[n]))]
                for n in processes]  # fmt: skip
        rows.append(["meshtron / loop", f"**{statistics.median(walls['meshtron']) / statistics.median(walls['minimal loop']):.3f}** "
                     f"(per round {', '.join(f'{r:.2f}' for r in per)})", ""])  # fmt: skip
        rep.blocks.append(table("process | median wall s | median step ms (its own records)", rows,
                                f"Whole process (`meshtron train` vs `{Path(__file__).name} --minimal`), alternating:"))  # fmt: skip
    print(f"per-step ratio {Ratio.paired(samples['meshtron'], samples['minimal loop'])}")
    rep.finish(argv, args.out)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--minimal"]:  # the loop's own process: torch and numpy only
        minimal_main(Path(argv[1]), int(argv[3]))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import reporting

    flags = reporting.parser(__doc__, steps=200, warmup=10)
    flags.add_argument("--check-steps", type=int, default=3, help="steps whose losses are checked first")
    flags.add_argument("--process-steps", type=int, default=300, help="steps of each whole-process run")
    flags.add_argument("--rounds", type=int, default=3, help="whole-process runs of each, alternating")
    args = flags.parse_args(argv)
    rep = reporting.Report(__file__, TITLE)
    from meshtron.utils.cache import cache_dir

    data = corpus(cache_dir())
    import tempfile

    with tempfile.TemporaryDirectory(prefix="meshtron-overhead-") as tmp:
        ours, peer, steps = in_process(data, Path(tmp), args)
        processes = whole_process(data, Path(tmp), args.process_steps, args.rounds) if args.rounds else {}
    report(rep, args, argv, data, (ours, peer), steps, processes)


if __name__ == "__main__":
    main()
