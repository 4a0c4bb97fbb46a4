"""`meshtron prepare-data`: tokenize text, source, jsonl and parquet files into a prepared token memmap."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.utils.words import plural


def cmd_prepare_data(args: argparse.Namespace) -> int:
    import time

    from meshtron.data.dataset import prepare_data

    start = time.perf_counter()
    # Progress on stderr when it is a terminal; in a log, the line below is all prepare-data prints.
    options = ("tokenizer", "vocab_size", "chat", "split", "text_field", "workers")  # named as the flags
    data = prepare_data(args.inputs, args.out, **{name: getattr(args, name) for name in options})
    seconds = time.perf_counter() - start
    print(
        f"wrote {data.n_tokens:,} tokens ({data.tokens.dtype}, vocab {data.vocab_size}, "
        f"{plural(data.n_documents, 'document')} from {plural(len(data.sources), 'file')}) to {Path(args.out)} in "
        f"{seconds:.1f} s ({data.n_tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    if data.loss_mask is not None:
        counted = int(data.loss_mask.sum())
        print(f"{counted:,} of them ({counted / data.n_tokens:.0%}) in assistant turns count in the loss")
    return 0
