"""Benchmark: one training step of meshtron's Llama model vs transformers' LlamaForCausalLM (fp32, CPU).

One training step (forward, cross-entropy outside both models, backward, AdamW, zero_grad) of the same
architecture with the same weights (written by `meshtron.hf.save`, loaded by `from_pretrained` with SDPA
attention), in one process with one thread count, on the same batch every step. Before anything is
timed both must give the same logits, and each one's first SDPA call is recorded to show that both take
the same attention path.
Method: benchmarks/RESULTS.md. E.g. `python benchmarks/model_step.py --preset small --steps 20 --profile`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import harness
import reporting
import torch
import torch.nn.functional as F
from harness import Clock, Pair, Runner
from reporting import ms, table
from torch import nn
from torch.overrides import TorchFunctionMode

import meshtron.hf
from meshtron.config.schema import ModelConfig
from meshtron.models.llama import build_model
from meshtron.parallel.compile import compile_blocks

TITLE = "## Model step: meshtron vs transformers (fp32, CPU)"
LOGITS_TOL = 1e-4
LR = 1e-4
# Model and batch shape and step counts of each preset: "small" is dominated by matmuls; "tiny" keeps
# the per-op framework overhead (Python, dispatch, many small kernels) visible.
SHAPE = ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps", "warmup")
PRESETS = {
    "small": dict(zip(SHAPE, (512, 4, 8, 4, 1408, 8192, 256, 4, 30, 5), strict=True)),
    "tiny": dict(zip(SHAPE, (128, 2, 4, 2, 352, 2048, 128, 4, 100, 10), strict=True)),
}


def model_config(s: dict[str, int]) -> ModelConfig:
    dims = dict(dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"], n_kv_heads=s["kv_heads"])
    return ModelConfig(**dims, ffn_dim=s["ffn"], vocab_size=s["vocab"])


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


class Model(Runner):
    def __init__(self, name: str, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.model, self.forward = name, model, forward
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], clock: Clock) -> float:
        inputs, targets = batch
        loss = lm_loss(self.forward(inputs), targets)
        clock.lap("forward")
        loss.backward()
        clock.lap("backward")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        return loss.item()


class SdpaRecorder(TorchFunctionMode):
    """Records how scaled_dot_product_attention is called, to show both models take the same path."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            flags = f"is_causal={bool(kwargs.get('is_causal'))} enable_gqa={bool(kwargs.get('enable_gqa'))}"
            self.calls.append(
                f"q{list(q.shape)} k{list(k.shape)} mask={'none' if mask is None else 'tensor'} {flags}"
            )
        return func(*args, **kwargs)


def build_runners(preset: str, s: dict[str, int], seed: int, compiled: bool = False) -> list[Model]:
    """meshtron's model and transformers' LlamaForCausalLM holding the very same weights; with
    `compiled`, also a second copy of each with every block `torch.compile`d (meshtron's
    `compile_blocks`, what `training.compile = true` does; each transformers decoder layer)."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its loading bar would interleave with the benchmark's output
    ours = build_model(model_config(s), seed).train()
    copies = 2 if compiled else 1
    with tempfile.TemporaryDirectory(prefix="meshtron-bench-") as tmp:
        meshtron.hf.save(ours, tmp)
        hf = [
            LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa").train()
            for _ in range(copies)
        ]
    if hf[0].config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers picked attn_implementation={hf[0].config._attn_implementation!r}")

    def hf_forward(theirs: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        # use_cache=False: the default would build a DynamicCache, which training never reads.
        return lambda x: theirs(input_ids=x, use_cache=False).logits

    runners = [
        Model(f"{preset} meshtron", ours, ours),
        Model(f"{preset} transformers", hf[0], hf_forward(hf[0])),
    ]
    if compiled:
        ours_compiled = build_model(model_config(s), seed).train()
        compile_blocks(ours_compiled)
        for layer in hf[1].model.layers:
            layer.compile()
        runners += [
            Model(f"{preset} meshtron compiled", ours_compiled, ours_compiled),
            Model(f"{preset} transformers compiled", hf[1], hf_forward(hf[1])),
        ]
    return runners


def same_function(runners: list[Model], inputs: torch.Tensor) -> tuple[float, list[str]]:
    """Max |logits difference| on the batch, and each model's first SDPA call; exits if they differ."""
    logits, calls = [], []
    for runner in runners:
        with torch.no_grad(), SdpaRecorder() as recorder:
            logits.append(runner.forward(inputs))
        calls.append(recorder.calls[0] if recorder.calls else "no SDPA call")
    diff = max((other - logits[0]).abs().max().item() for other in logits[1:])
    if diff > LOGITS_TOL:
        sys.exit(f"the models disagree: max |logits diff| {diff:.2e} > {LOGITS_TOL}; not timing them")
    return diff, calls


def run_preset(
    preset: str, s: dict[str, int], seed: int, profile: bool, report: reporting.Report, compiled: bool
) -> list[list[str]]:
    """Checks and times one preset: its rows of the steps table; its samples, checks and facts go into
    `report`."""
    runners = build_runners(preset, s, seed, compiled)
    batch = harness.token_batch(s["vocab"], s["batch"], s["seq"], seed, 0)
    diff, calls = same_function(runners, batch[0])
    pairs = [Pair(runners[0].name, runners[1].name)]
    if compiled:  # compiled against compiled, and what compiling gains meshtron
        pairs += [Pair(runners[2].name, runners[3].name), Pair(runners[2].name, runners[0].name)]
    result = harness.run_rounds(
        runners, lambda _: batch, pairs, s["warmup"], s["steps"], measure=False, op_tables=profile
    )
    samples = report.add([result])
    n_params = sum(p.numel() for p in runners[0].model.parameters())
    report.facts.append(
        f"{preset}: {reporting.model_text(model_config(s))}, batch {s['batch']} x seq {s['seq']}; {n_params / 1e6:.1f}M "
        f"parameters; {s['steps']} timed steps after the check step and {s['warmup']} warmup; max |logits diff| "
        f"{diff:.1e}; first SDPA call meshtron `{calls[0]}`, transformers `{calls[1]}`"
    )
    rows = []
    for sample in samples.values():
        parts = [sample.phase(p) for p in ("forward", "backward", "optimizer")]
        split = " / ".join(f"{ms(p)} ({p / sum(parts):.0%})" for p in parts)
        rows.append(
            [
                *sample.name.split(" ", 1),
                *sample.timing(),
                f"{s['batch'] * s['seq'] / sample.median:,.0f}",
                split,
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    import transformers

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__, steps=None, warmup=None)
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="one preset (default: all; 'small' with shape flags)"
    )
    for flag in SHAPE[:-2]:
        parser.add_argument(
            f"--{flag.replace('_', '-')}", type=int, dest=flag, help="overrides the preset's value"
        )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    parser.add_argument("--compile", action="store_true", help="also both models with compiled blocks")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None}
    custom = set(overrides) - {"steps", "warmup"}
    presets = [args.preset or "small"] if custom else [args.preset] if args.preset else list(PRESETS)
    report, rows = reporting.Report(__file__, TITLE), []
    for preset in presets:
        shape = PRESETS[preset] | overrides
        name = f"{preset}-custom" if custom else preset
        rows += run_preset(name, shape, args.seed, args.profile, report, args.compile)
    report.facts.insert(
        0, f"transformers {transformers.__version__}; `torch.set_num_threads({args.threads})`"
    )
    report.blocks = [
        reporting.comparison_table(report.pairs, report.samples),
        table(
            "preset | model | median step ms | p10 ms | p90 ms | tokens/s | forward / backward / optimizer ms (share)",
            rows,
            "Steps (forward includes the loss, optimizer `zero_grad`; each phase its median):",
        ),
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
