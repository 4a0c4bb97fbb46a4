"""Documents for prepare-data: read from files and Hugging Face datasets, tokenized in this process or in
`workers` processes.

With workers, documents go out in chunks of CHUNK to a process pool (spawned, each loading the
tokenizer once) and come back in their order (`imap`), so the prepared tokens are the same bytes
whatever the number of workers; at most a few chunks per worker are in flight, so memory stays bounded.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from meshtron.data.corpus import iter_documents
from meshtron.data.hf_datasets import dataset_documents
from meshtron.data.tokenizer import Tokenizer, load_tokenizer

CHUNK = 256
Text = tuple[int, str, str]  # (inputs finished before it, its source's name, its text)
Document = tuple[int, str, np.ndarray, "np.ndarray | None"]  # (inputs done, source, ids, loss mask)


def text_documents(
    files: Sequence[Path], datasets: Sequence[str], split: str, text_field: str
) -> Iterator[Text]:
    """Every document of `files` (each file, .jsonl line, .parquet row), then of `datasets`."""
    for done, file in enumerate(files):
        for path, text in iter_documents([file]):
            yield done, str(path.resolve()), text  # absolute: meta.json says where it came from
    for k, spec in enumerate(datasets):
        name = spec if spec.startswith("hf:") else str(Path(spec).resolve())
        for text in dataset_documents(spec, split, text_field):
            yield len(files) + k, name, text


def encoded(
    texts: Iterator[Text], tok: Tokenizer, tok_spec: str, dtype: np.dtype, workers: int
) -> Iterator[Document]:
    """`texts` tokenized, in order (every token counts: no mask). `tok_spec`: how a worker loads `tok`
    ("byte" or a tokenizer.json path)."""
    if workers <= 1:
        for done, source, text in texts:
            yield done, source, np.asarray(tok.encode(text), dtype=dtype), None
        return
    chunks = iter(lambda: list(itertools.islice(texts, CHUNK)), [])
    context = multiprocessing.get_context("spawn")
    initargs = (tok_spec, getattr(tok, "eos_token", None), tok.eos_id)
    with context.Pool(workers, initializer=_load, initargs=initargs) as pool:
        for chunk, ids in zip_chunks(chunks, pool):
            for (done, source, _), one in zip(chunk, ids, strict=True):
                yield done, source, np.asarray(one, dtype=dtype), None


def zip_chunks(
    chunks: Iterator[list[Text]], pool: multiprocessing.pool.Pool
) -> Iterator[tuple[list[Text], list]]:
    """(chunk, its token ids) in order, with the texts of a chunk kept only until its ids are back."""
    pending: list[list[Text]] = []

    def feed() -> Iterator[list[str]]:
        for chunk in chunks:
            pending.append(chunk)
            yield [text for _, _, text in chunk]

    for ids in pool.imap(_encode_chunk, feed()):
        yield pending.pop(0), ids


_WORKER_TOKENIZER: list[Tokenizer] = []


def _load(tok_spec: str, eos_token: str | None, eos_id: int) -> None:
    tok = load_tokenizer(tok_spec, eos_token=eos_token if tok_spec != "byte" else None)
    if tok.eos_id != eos_id:
        raise RuntimeError(f"worker tokenizer {tok_spec} has eos {tok.eos_id}, the parent's {eos_id}")
    _WORKER_TOKENIZER.append(tok)


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    return [_WORKER_TOKENIZER[0].encode(text) for text in texts]
