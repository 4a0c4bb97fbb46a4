"""Benchmark: what per-document attention costs, against causal attention over the same packed window.

One window of `--seq` tokens packed with documents (lengths uniform in 1..2·mean, seeded), one process,
fp32 on CPU. Forward and backward of one attention layer's core (q [1, 8, S, 64], k and v with 2 heads):

  causal          meshtron's blockwise attention without a mask (what a window costs today)
  docs fused      meshtron's blockwise attention with the document ids: PyTorch's fused CPU kernel on
                  tiles that skip the keys of earlier documents, with the mask as an additive one
  docs tiled      the same on the plain-tensor path (what CUDA and sliding windows take)
  docs sdpa       SDPA with the dense [S, S] document mask (meshtron's path on CUDA; transformers' with
                  a 4-D mask); meshtron on CPU takes "docs fused" instead, with or without cp
  docs flex       PyTorch's flex_attention with a document block mask, compiled (torchtitan's path);
                  forward only where its backward is not supported (it says so on CPU)

All outputs must equal SDPA's before anything is timed. Also, for the same window: the share of the
causal (query, key) pairs the mask leaves, and the ring steps context parallel skips whole at cp 2, 4, 8
(`meshtron context --documents` draws them). E.g. `python benchmarks/document_attention.py --seq 4096`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence

import reporting
import torch
import torch.nn.functional as F
from reporting import ms, table

from meshtron.models.attention import document_causal_mask
from meshtron.models.blockwise_attention import block_backward, block_forward
from meshtron.models.documents import document_layout
from meshtron.pictures.documents import skipped_steps

TITLE = "## Per-document attention: what the mask costs and saves (CPU, fp32)"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
TOL = 1e-4


def packed_window(seq: int, mean: int, seed: int) -> torch.Tensor:
    """Document ids [1, seq] of documents of 1..2·mean tokens (the last one cut by the window)."""
    generator, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, 2 * mean + 1, (1,), generator=generator)))
    ends = torch.zeros(1, seq, dtype=torch.long)
    ends[0, torch.tensor(lengths).cumsum(0)[:-1] - 1] = 1
    return document_layout(ends, 1)[1]


def blockwise(docs: torch.Tensor | None, fused: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(q, k, v, dout):
        pos = torch.arange(q.shape[2])
        both = None if docs is None else (docs, docs)
        out, lse = block_forward(q, k, v, pos, pos, allow_fused=fused, docs=both)
        return (out, *block_backward(q, k, v, pos, pos, out, lse, dout, allow_fused=fused, docs=both))

    return run


def sdpa(docs: torch.Tensor) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(docs), enable_gqa=True)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    return run


def flex(docs: torch.Tensor) -> tuple[Callable[..., tuple[torch.Tensor, ...]] | None, str]:
    """flex_attention with a document block mask, forward only here; (None, why) if it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ids = docs[0]
        mask = create_block_mask(
            lambda b, h, q, k: (q >= k) & (ids[q] == ids[k]), 1, None, ids.numel(), ids.numel(), device="cpu"
        )
        compiled = torch.compile(flex_attention)
        probe = torch.zeros(1, HEADS, ids.numel(), HEAD_DIM, requires_grad=True)
        try:
            compiled(probe, probe[:, :KV_HEADS], probe[:, :KV_HEADS], block_mask=mask, enable_gqa=True)
            why = ""
        except NotImplementedError as err:
            why = f"backward: {err}".split(". ")[0]

        def run(q, k, v, dout):
            return (compiled(q, k, v, block_mask=mask, enable_gqa=True),)

        return run, why
    except Exception as err:  # noqa: BLE001 - whatever it raises is the finding
        return None, f"{type(err).__name__}: {str(err).splitlines()[0]}"


def timed(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple, repeats: int) -> float:
    fn(*inputs)  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def window_rows(seq: int, mean: int, seed: int, repeats: int) -> tuple[list[list[str]], str]:
    """The timing rows of one window (after checking every output against SDPA's), and flex's note."""
    docs = packed_window(seq, mean, seed)
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=gen) for _ in range(2))
    inputs = (q, k, v, dout)
    want = sdpa(docs)(*inputs)
    flex_run, flex_note = flex(docs)
    runs = {
        "docs fused": blockwise(docs, True),
        "docs tiled": blockwise(docs, False),
        "docs sdpa": sdpa(docs),
    }
    if flex_run is not None:
        runs["docs flex" + (" (forward only)" if flex_note else "")] = flex_run
    for name, run in runs.items():
        for got, ref in zip(run(*inputs), want, strict=False):
            error = float((got - ref).abs().max())
            if not error <= TOL:
                sys.exit(f"{name} differs from SDPA by {error:.2e} (mean document {mean}): nothing timed")
    causal = timed(blockwise(None, True), (q, k, v, dout), repeats)
    rows = [[f"{mean}", "causal (no mask)", ms(causal), "1"]]
    for name, run in runs.items():
        seconds = timed(run, inputs, repeats)
        rows.append([f"{mean}", name, ms(seconds), f"{causal / seconds:.2f}x"])
    return rows, flex_note


def savings_row(seq: int, mean: int, seed: int) -> list[str]:
    docs = packed_window(seq, mean, seed)
    causal_pairs = seq * (seq + 1) / 2
    visible = float(document_causal_mask(docs).sum())
    cells = []
    for ring in (2, 4, 8):
        skipped = sum(map(sum, skipped_steps(docs, ring)))
        cells.append(f"{skipped} of {ring * ring}")
    n_docs = int(docs.max()) + 1
    return [f"{mean}", f"{n_docs}", f"{100 * visible / causal_pairs:.1f}%", *cells]


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = reporting.parser(__doc__, steps=3, warmup=None)
    parser.add_argument("--seq", type=int, default=4096, help="tokens in the window")
    parser.add_argument(
        "--means", type=int, nargs="+", default=[128, 512, 2048], help="mean document lengths"
    )
    args = parser.parse_args(argv)
    report = reporting.Report(__file__, TITLE)
    rows, notes = [], set()
    for mean in args.means:
        window, note = window_rows(args.seq, mean, args.seed, args.steps)
        rows += window
        notes.add(note)
    savings = [savings_row(args.seq, mean, args.seed) for mean in args.means]
    report.blocks += [
        table(
            "mean document tokens | attention | forward + backward ms (median) | speed vs causal",
            rows,
            f"One window of {args.seq} tokens, q [1, {HEADS}, S, {HEAD_DIM}], k/v {KV_HEADS} heads; every "
            f"output equal to SDPA's within {TOL:g} before timing:",
        ),
        table(
            "mean document tokens | documents in the window | causal pairs left by the mask "
            "| ring steps skipped whole, cp=2 | cp=4 | cp=8",
            savings,
            "What the mask saves in the same windows (counted, not timed):",
        ),
    ]
    report.facts = [
        f"threads: {torch.get_num_threads()}; {args.steps} timed repeats after one warm-up",
        "flex_attention: " + ("; ".join(sorted(n for n in notes if n)) or "forward and backward ran"),
    ]
    report.finish(argv, args.out)


if __name__ == "__main__":
    main()
