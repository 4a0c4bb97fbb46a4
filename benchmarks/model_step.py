"""Benchmark: one training step of meshtron's Llama model vs transformers' LlamaForCausalLM (fp32, CPU).

What is measured: the wall time of one training step -- forward, loss, backward, and an
`AdamW(lr=1e-4, foreach=True)` step (with `zero_grad(set_to_none=True)`) -- for the same
architecture with the same weights, in the same process, with the same thread count.

How:
  * the meshtron model is built with `build_model(cfg, seed)`, written as a Hugging Face directory
    with `meshtron.hf.save`, and loaded with `LlamaForCausalLM.from_pretrained(dir, dtype=float32,
    attn_implementation="sdpa")`, so both hold identical weights and both run attention through
    `torch.nn.functional.scaled_dot_product_attention`;
  * before timing, both models must give the same logits (max |diff| <= 1e-4) and loss on the batch,
    and every SDPA call they make is recorded (mask / is_causal / enable_gqa) to show they take the
    same attention path;
  * the loss is computed outside both models the same way: cross-entropy of the logits against the
    next tokens, mean over tokens (transformers' internal loss is not used). transformers is called
    with `use_cache=False`, as a training loop does: its config defaults to building a KV cache;
  * after `--warmup` untimed steps each, the models alternate step by step (A, B, A, B, ...) so
    machine noise hits both alike; each phase is timed with `time.perf_counter` (CPU execution is
    synchronous, so no device synchronisation is needed);
  * reported per model: median, p10 and p90 step time, the median forward / backward / optimizer
    split, tokens per second; and the ratio of median step times, meshtron / transformers
    (< 1 means meshtron is faster), with the median of the per-pair ratios and its distribution-free
    95% confidence interval, to tell a real difference from noise.

Run `python benchmarks/model_step.py` for both presets (writes benchmarks/RESULTS.md), or e.g.
`python benchmarks/model_step.py --preset small --steps 20 --profile` to add a per-op profile.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import cpu_model, median_ci, ms, quantile, write_results
from torch import nn
from torch.overrides import TorchFunctionMode

import meshtron.hf
from meshtron.config import ModelConfig, load_config
from meshtron.models.llama import build_model

SECTION_TITLE = "## Model step: meshtron vs transformers (fp32, CPU)"
LOGITS_TOL = 1e-4
LOSS_TOL = 1e-5
LR = 1e-4

# Model shape, batch shape and step counts of each preset. "small" is dominated by matmuls; "tiny"
# keeps the per-op framework overhead (Python, dispatch, many small kernels) visible.
PRESETS: dict[str, dict[str, int]] = {
    "small": dict(
        dim=512, layers=4, heads=8, kv_heads=4, ffn=1408, vocab=8192, seq=256, batch=4, steps=30, warmup=5
    ),
    "tiny": dict(
        dim=128, layers=2, heads=4, kv_heads=2, ffn=352, vocab=2048, seq=128, batch=4, steps=100, warmup=10
    ),
}
SHAPE_FLAGS = ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps", "warmup")


@dataclass
class Run:
    """One benchmark row: its shape and what it measured."""

    name: str
    shape: dict[str, int]
    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # model -> phase -> seconds
    logits_diff: float = 0.0
    loss: dict[str, float] = field(default_factory=dict)
    final_loss: dict[str, float] = field(default_factory=dict)
    sdpa: dict[str, str] = field(default_factory=dict)
    n_params: int = 0

    @property
    def tokens(self) -> int:
        return self.shape["batch"] * self.shape["seq"]

    def median(self, model: str, phase: str = "step") -> float:
        return statistics.median(self.times[model][phase])

    def quantile(self, model: str, q: float) -> float:
        return quantile(self.times[model]["step"], q)

    @property
    def ratio(self) -> float:
        return self.median("meshtron") / self.median("transformers")

    def paired_ratios(self) -> list[float]:
        """meshtron / transformers for each adjacent pair of steps: its spread shows how noisy the ratio is."""
        return sorted(
            a / b
            for a, b in zip(self.times["meshtron"]["step"], self.times["transformers"]["step"], strict=True)
        )


def paired_text(run: Run) -> str:
    r = run.paired_ratios()
    lo, hi = median_ci(r)
    return f"per-pair ratio median {statistics.median(r):.3f} (95% CI {lo:.3f}-{hi:.3f})"


def verdict(run: Run) -> str:
    lo, hi = median_ci(run.paired_ratios())
    if lo <= 1.0 <= hi:
        return "no significant difference"
    return "meshtron faster" if hi < 1.0 else "meshtron slower"


class SdpaRecorder(TorchFunctionMode):
    """Records how scaled_dot_product_attention is called, to show both models use the same kernel path."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append(
                f"q{list(q.shape)} k{list(k.shape)} mask={'none' if mask is None else 'tensor'} "
                f"is_causal={bool(kwargs.get('is_causal', False))} enable_gqa={bool(kwargs.get('enable_gqa', False))}"
            )
        return func(*args, **kwargs)


def model_config(shape: dict[str, int]) -> ModelConfig:
    overrides = [
        f"--model.dim={shape['dim']}",
        f"--model.n_layers={shape['layers']}",
        f"--model.n_heads={shape['heads']}",
        f"--model.n_kv_heads={shape['kv_heads']}",
        f"--model.ffn_dim={shape['ffn']}",
        f"--model.vocab_size={shape['vocab']}",
    ]
    return load_config(None, overrides).model


def build_pair(cfg: ModelConfig, seed: int) -> tuple[nn.Module, nn.Module]:
    """meshtron's model and transformers' LlamaForCausalLM holding the very same weights."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its loading bar would interleave with the benchmark's output

    ours = build_model(cfg, seed)
    with tempfile.TemporaryDirectory(prefix="meshtron-bench-") as tmp:
        meshtron.hf.save(ours, tmp)
        theirs = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    impl = theirs.config._attn_implementation
    if impl != "sdpa":
        raise RuntimeError(f"transformers picked attn_implementation={impl!r}, expected 'sdpa'")
    return ours.train(), theirs.train()


def forward_fns(ours: nn.Module, theirs: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {
        "meshtron": lambda x: ours(x),
        # use_cache=False: the config's default (True) would build a DynamicCache, which training never reads.
        "transformers": lambda x: theirs(input_ids=x, use_cache=False).logits,
    }


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))


def check_same(
    run: Run,
    fwd: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> None:
    """Refuse to time unless both models compute the same function through the same SDPA path."""
    logits: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, f in fwd.items():
            recorder = SdpaRecorder()
            with recorder:
                logits[name] = f(inputs)
            run.loss[name] = lm_loss(logits[name], targets).item()
            run.sdpa[name] = recorder.calls[0] if recorder.calls else "no SDPA call"
    run.logits_diff = (logits["meshtron"] - logits["transformers"]).abs().max().item()
    loss_diff = abs(run.loss["meshtron"] - run.loss["transformers"])
    if run.logits_diff > LOGITS_TOL or loss_diff > LOSS_TOL:
        raise RuntimeError(
            f"[{run.name}] the models disagree: max |logits diff| {run.logits_diff:.2e} (tol {LOGITS_TOL}), "
            f"|loss diff| {loss_diff:.2e} (tol {LOSS_TOL}); not timing different computations"
        )


def train_step(
    f: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[float, float, float, float]:
    """Seconds spent in forward (incl. loss), backward and optimizer (incl. zero_grad); and the loss."""
    t0 = time.perf_counter()
    loss = lm_loss(f(inputs), targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, loss.item()


def profile(
    name: str,
    f: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    steps: int = 3,
    rows: int = 25,
) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step(f, opt, inputs, targets)
    print(f"\n--- profile: {name}, {steps} steps, top ops by self CPU time ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def run_preset(name: str, shape: dict[str, int], seed: int, do_profile: bool) -> Run:
    run = Run(name=name, shape=shape)
    cfg = model_config(shape)
    ours, theirs = build_pair(cfg, seed)
    run.n_params = sum(p.numel() for p in ours.parameters())
    fwd = forward_fns(ours, theirs)

    torch.manual_seed(seed)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    check_same(run, fwd, inputs, targets)

    opts = {
        "meshtron": torch.optim.AdamW(ours.parameters(), lr=LR, foreach=True),
        "transformers": torch.optim.AdamW(theirs.parameters(), lr=LR, foreach=True),
    }
    order = ("meshtron", "transformers")
    run.times = {m: {"forward": [], "backward": [], "optimizer": [], "step": []} for m in order}
    for _ in range(shape["warmup"]):
        for m in order:
            train_step(fwd[m], opts[m], inputs, targets)
    for _ in range(shape["steps"]):
        for m in order:
            t_fwd, t_bwd, t_opt, loss = train_step(fwd[m], opts[m], inputs, targets)
            for phase, t in (("forward", t_fwd), ("backward", t_bwd), ("optimizer", t_opt)):
                run.times[m][phase].append(t)
            run.times[m]["step"].append(t_fwd + t_bwd + t_opt)
            run.final_loss[m] = loss
    if do_profile:
        for m in order:
            profile(f"{name} / {m}", fwd[m], opts[m], inputs, targets)
    return run


def shape_text(shape: dict[str, int]) -> str:
    s = shape
    return (
        f"dim {s['dim']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} kv, ffn {s['ffn']}, "
        f"vocab {s['vocab']}, batch {s['batch']} x seq {s['seq']}"
    )


def split_text(run: Run, model: str) -> str:
    """Median forward / backward / optimizer in ms, and each as a share of their sum."""
    parts = [run.median(model, p) for p in ("forward", "backward", "optimizer")]
    total = sum(parts)
    return " / ".join(f"{ms(p)} ({100 * p / total:.0f}%)" for p in parts)


TABLE_HEADER = (
    "| preset | config | params | model | median step ms | p10 ms | p90 ms | tokens/s "
    "| fwd / bwd / opt ms (share) | ratio (meshtron / transformers) |"
)
TABLE_RULE = "|---|---|---:|---|---:|---:|---:|---:|---|---:|"


def table_rows(runs: Sequence[Run]) -> list[str]:
    rows = []
    for run in runs:
        for i, m in enumerate(("meshtron", "transformers")):
            first = i == 0
            rows.append(
                "| "
                + " | ".join(
                    [
                        run.name if first else "",
                        shape_text(run.shape) if first else "",
                        f"{run.n_params / 1e6:.1f}M" if first else "",
                        m,
                        ms(run.median(m)),
                        ms(run.quantile(m, 0.1)),
                        ms(run.quantile(m, 0.9)),
                        f"{run.tokens / run.median(m):,.0f}",
                        split_text(run, m),
                        f"**{run.ratio:.3f}**" if first else "",
                    ]
                )
                + " |"
            )
    return rows


def command_text(argv: Sequence[str]) -> str:
    return " ".join(["python", "benchmarks/model_step.py", *argv])


def section_text(runs: Sequence[Run], threads: int, argv: Sequence[str]) -> str:
    import transformers

    lines = [
        SECTION_TITLE,
        "",
        "One training step (forward + cross-entropy loss + backward + `AdamW(lr=1e-4, foreach=True)` step) of "
        "meshtron's `Transformer` vs transformers' `LlamaForCausalLM` with the same config and weights "
        "(written by `meshtron.hf.save`, loaded with `from_pretrained(dtype=torch.float32, "
        'attn_implementation="sdpa")`), fp32 on CPU, same process and thread count. The loss is computed '
        "outside both models; transformers runs with `use_cache=False`. The models alternate step by step "
        "after warmup. **ratio** = median meshtron step / median transformers step (< 1: meshtron faster). "
        "The forward / backward / optimizer split is the median of each phase (forward includes the loss, "
        "optimizer includes `zero_grad`). The per-pair ratio compares the two adjacent steps of each pair; "
        "its 95% confidence interval covers step-to-step noise within this run, not drift between runs, so "
        "rerun before trusting a difference of about 1%.",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs), `torch.set_num_threads({threads})`",
        f"- reproduce: `{command_text(argv)}`",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *table_rows(runs),
        "",
        "Checks (logits and loss on the same batch with the initial weights, loss after the last step) and noise:",
        "",
    ]
    for run in runs:
        lines.append(
            f"- {run.name}: max |logits diff| {run.logits_diff:.1e}, loss {run.loss['meshtron']:.6f} (meshtron) vs "
            f"{run.loss['transformers']:.6f} (transformers); after {run.shape['warmup'] + run.shape['steps']} "
            f"steps each: {run.final_loss['meshtron']:.6f} vs {run.final_loss['transformers']:.6f}; "
            f"{run.shape['steps']} timed steps after {run.shape['warmup']} warmup; {paired_text(run)}: {verdict(run)}"
        )
        for m in ("meshtron", "transformers"):
            lines.append(f"  - SDPA call ({m}): `{run.sdpa[m]}`")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="one preset; without it and without shape flags, every preset runs. Shape flags override it; "
        "with shape flags and no preset they override 'small'",
    )
    for flag in SHAPE_FLAGS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            type=int,
            dest=flag,
            default=None,
            help="overrides the preset's value",
        )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads for both models"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights (build_model) and token batch")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "RESULTS.md"),
        help="results file to update; '-' writes nothing",
    )
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler op table per model")
    return parser.parse_args(argv)


def selected_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, int]]]:
    overrides = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.preset is None and not overrides:
        return [(name, dict(shape)) for name, shape in PRESETS.items()]
    base = args.preset or "small"
    changed = {k for k, v in overrides.items() if PRESETS[base][k] != v}
    shape_changed = changed - {"steps", "warmup"}
    return [(f"{base} (custom)" if shape_changed else base, {**PRESETS[base], **overrides})]


def print_summary(runs: Sequence[Run], threads: int) -> None:
    import transformers

    print(
        f"\ntorch {torch.__version__}, transformers {transformers.__version__}, CPU {cpu_model()}, "
        f"threads {threads}, fp32; attention: SDPA in both (transformers attn_implementation='sdpa')"
    )
    for run in runs:
        print(f"\n[{run.name}] {shape_text(run.shape)}, {run.n_params / 1e6:.1f}M params")
        print(
            f"  check: max |logits diff| {run.logits_diff:.1e}, loss {run.loss['meshtron']:.6f} vs "
            f"{run.loss['transformers']:.6f}"
        )
        for m in ("meshtron", "transformers"):
            print(f"  SDPA {m:>12}: {run.sdpa[m]}")
        print(
            f"  {'model':>12} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'tokens/s':>10}   fwd / bwd / opt ms (share)"
        )
        for m in ("meshtron", "transformers"):
            print(
                f"  {m:>12} {ms(run.median(m)):>10} {ms(run.quantile(m, 0.1)):>8} {ms(run.quantile(m, 0.9)):>8} "
                f"{run.tokens / run.median(m):>10,.0f}   {split_text(run, m)}"
            )
        print(f"  ratio meshtron / transformers: {run.ratio:.3f}; {paired_text(run)}: {verdict(run)}")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    for name, shape in selected_runs(args):
        print(
            f"running {name}: {shape_text(shape)}, {shape['warmup']} warmup + {shape['steps']} timed steps each"
        )
        runs.append(run_preset(name, shape, args.seed, args.profile))
    print_summary(runs, args.threads)
    if args.out != "-":
        out = Path(args.out)
        write_results(out, SECTION_TITLE, section_text(runs, args.threads, argv))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
