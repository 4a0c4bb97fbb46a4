"""Helpers shared by the benchmark scripts: robust statistics, number formatting, the machine's CPU,
memory accounting (storage bytes, profiler allocation peak) and updating one section of RESULTS.md.

The scripts run as `python benchmarks/<name>.py`, so this directory is on `sys.path` and they import
it as `common` (the spawned worker ranks inherit that path).
"""

from __future__ import annotations

import argparse
import math
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtron.config import ModelConfig

RESULTS_TITLE = "# meshtron benchmark results"


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile, q in [0, 1]."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)  # linear interpolation: with a few dozen samples a nearest-rank p10 jumps
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median, from binomial order statistics.

    Step times are skewed by machine noise, so a normal-theory interval would mislead.
    """
    xs = sorted(values)
    n = len(xs)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return xs[lo], xs[hi]


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def allocation_peak(prof: torch.profiler.profile) -> int:
    """Peak of bytes allocated minus freed since the profiler started (from its allocation events)."""
    from torch._C._profiler import _EventType

    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            nodes.append(node)
    current = peak = 0
    for node in sorted(nodes, key=lambda n: n.start_time_ns):
        current += node.extra_fields.alloc_size
        peak = max(peak, current)
    return peak


def write_results(path: Path, section_title: str, section: str, results_title: str = RESULTS_TITLE) -> None:
    """Replace only the `section_title` section of the results file (up to the next `## ` heading) with
    `section`, keeping the others; append it if missing, and create the file (under `results_title`) if
    there is none."""
    if not path.exists():
        path.write_text(f"{results_title}\n\n{section}")
        return
    text = path.read_text()
    pattern = re.compile(rf"^{re.escape(section_title)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        # Keep one blank line before a following section.
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


@dataclass(frozen=True)
class ModelShape:
    """The benchmarked Llama's size (dense, untied head)."""

    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 688
    vocab: int = 4096
    seq: int = 128

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            dim=self.dim,
            n_layers=self.layers,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            ffn_dim=self.ffn,
            vocab_size=self.vocab,
        )

    def model_text(self) -> str:
        return (
            f"dim {self.dim}, {self.layers} layers, {self.heads} heads / {self.kv_heads} kv, ffn {self.ffn}, "
            f"vocab {self.vocab}, seq {self.seq}"
        )


def timed_run_parser(doc: str, section: str) -> argparse.ArgumentParser:
    """The arguments every side-by-side benchmark takes: timed and warm-up steps, the results file whose
    `section` it replaces, and the seed."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "RESULTS.md"),
        help=f"results file whose {section} section is replaced; '-' writes nothing",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights (build_model) and token batches")
    return parser
