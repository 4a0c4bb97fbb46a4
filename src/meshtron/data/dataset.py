"""Prepared datasets: one flat token memmap on disk, written atomically, and the cached default corpus.

A prepared dataset is a directory holding one flat ``tokens.bin`` (documents joined, each followed by the
end-of-document token), a ``meta.json`` describing it and, for learned tokenizers, a ``tokenizer.json``
(a given one with its special tokens and chat template files, data/tokenizer_files.py).
``meta.json`` is written last and atomically, so its presence marks a complete dataset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshtron.data import DataError
from meshtron.data.chat import ChatTemplate, chat_documents
from meshtron.data.corpus import collect_files, stdlib_files
from meshtron.data.encode import Document, encoded, text_documents
from meshtron.data.hf_datasets import is_dataset_input
from meshtron.data.progress import Progress
from meshtron.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer, Tokenizer, train_bpe
from meshtron.data.tokenizer_files import COMPANIONS, companion_files
from meshtron.utils.cache import cache_dir as meshtron_cache_dir
from meshtron.utils.words import plural

logger = logging.getLogger(__name__)

TOKENS_FILE = "tokens.bin"
LOSS_MASK_FILE = "loss_mask.bin"  # chat data: 1 byte per token, 1 where the token counts as a target
META_FILE = "meta.json"
# Bounds memory while writing: tokens are flushed to disk once this many are buffered.
_FLUSH_TOKENS = 1 << 20
# BPE merges converge long before a big corpus is exhausted; capping training keeps prepare-data fast.
DEFAULT_BPE_TRAIN_BYTES = 256 << 20

PREPARE_HINT = "run `meshtron prepare-data` (or meshtron.data.dataset.prepare_data) to (re)build it"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every token id: halves disk and page cache for vocabularies <= 64K."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


@dataclass(kw_only=True)
class PreparedData:
    """A prepared dataset directory with its tokens memory-mapped read-only."""

    path: Path
    tokens: np.ndarray
    vocab_size: int
    eos_id: int
    tokenizer_spec: str
    n_documents: int
    sources: list[str] = field(default_factory=list)
    loss_mask: np.ndarray | None = None  # uint8 per token (chat data): 1 where it counts as a target

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.n_tokens

    def held_out(self, fraction: float) -> tuple[PreparedData, PreparedData]:
        """(this data without its last `fraction` of tokens, that last part), loss masks cut alike."""
        cut = self.n_tokens - int(round(fraction * self.n_tokens))
        mask = self.loss_mask
        head = dataclasses.replace(
            self, tokens=self.tokens[:cut], loss_mask=None if mask is None else mask[:cut]
        )
        tail = dataclasses.replace(
            self, tokens=self.tokens[cut:], loss_mask=None if mask is None else mask[cut:]
        )
        return head, tail

    @property
    def tokenizer_path(self) -> Path | None:
        return None if self.tokenizer_spec == "byte" else self.path / self.tokenizer_spec

    def load_tokenizer(self) -> Tokenizer:
        if self.tokenizer_spec == "byte":
            return ByteTokenizer()
        tok = HFTokenizer(self.path / self.tokenizer_spec)
        if tok.eos_id != self.eos_id or tok.vocab_size != self.vocab_size:
            raise DataError(
                f"{tok.path} does not match {self.path / META_FILE} (eos/vocab differ); {PREPARE_HINT}"
            )
        return tok

    @classmethod
    def open(cls, path: str | Path) -> PreparedData:
        path = Path(path)
        meta_path, tokens_path = path / META_FILE, path / TOKENS_FILE
        if not path.is_dir():
            raise DataError(f"no prepared dataset at {path}: {PREPARE_HINT}")
        if not meta_path.is_file():
            state = "is incomplete (interrupted prepare?)" if tokens_path.exists() else "has no meta.json"
            raise DataError(f"dataset {path} {state}: {PREPARE_HINT}")
        try:
            meta = json.loads(meta_path.read_text())
            n_tokens = int(meta["n_tokens"])
            dtype_name = str(meta["dtype"])
            vocab_size = int(meta["vocab_size"])
            eos_id = int(meta["eos_id"])
            tok_spec = str(meta["tokenizer"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{meta_path} is malformed ({type(e).__name__}: {e}): {PREPARE_HINT}") from e
        if dtype_name not in ("uint16", "uint32"):
            raise DataError(
                f"{meta_path} has dtype {dtype_name!r}, expected uint16 or uint32: {PREPARE_HINT}"
            )
        dtype = np.dtype(dtype_name)
        if dtype.itemsize < dtype_for_vocab(vocab_size).itemsize:
            raise DataError(
                f"{meta_path}: dtype {dtype_name} cannot hold vocab_size {vocab_size}: {PREPARE_HINT}"
            )
        if not 0 <= eos_id < vocab_size:
            raise DataError(f"{meta_path}: eos_id {eos_id} outside vocab_size {vocab_size}: {PREPARE_HINT}")
        if n_tokens <= 0:
            raise DataError(f"{meta_path} records {n_tokens} tokens: {PREPARE_HINT}")
        if not tokens_path.is_file():
            raise DataError(f"{tokens_path} is missing: {PREPARE_HINT}")
        size, expected = tokens_path.stat().st_size, n_tokens * dtype.itemsize
        if size != expected:
            raise DataError(
                f"{tokens_path} has {size} bytes but meta.json says {n_tokens} {dtype_name} tokens "
                f"({expected} bytes); the dataset is corrupt or from another run: {PREPARE_HINT}"
            )
        if tok_spec != "byte" and not (path / tok_spec).is_file():
            raise DataError(f"{path / tok_spec} (the dataset's tokenizer) is missing: {PREPARE_HINT}")
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(n_tokens,))
        loss_mask = None
        if "loss_mask" in meta:
            mask_path = path / str(meta["loss_mask"])
            if not mask_path.is_file() or mask_path.stat().st_size != n_tokens:
                raise DataError(f"{mask_path} is missing or not one byte per token: {PREPARE_HINT}")
            loss_mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(n_tokens,))
        return cls(
            path=path,
            tokens=tokens,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer_spec=tok_spec,
            n_documents=int(meta.get("n_documents", 0)),
            sources=list(meta.get("sources", [])),
            loss_mask=loss_mask,
        )


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _dataset_tokenizer(
    spec: str,
    files: list[Path],
    out_dir: Path,
    vocab_size: int,
    eos_token: str | None,
    bpe_train_bytes: int | None,
    progress: Progress,
) -> tuple[Tokenizer, str]:
    """The tokenizer a dataset in `out_dir` is written with, and how meta.json names it: bytes, a BPE
    trained on `files` (saved into out_dir), or a given tokenizer.json (copied into out_dir, with the
    special tokens and chat template files beside it: tokenizer_files.py)."""
    tok_path = out_dir / TOKENIZER_FILE
    if spec == "byte":
        _copy_tokenizer_files(None, out_dir)
        tok_path.unlink(missing_ok=True)
        return ByteTokenizer(), "byte"
    if spec == "bpe":
        _copy_tokenizer_files(None, out_dir)
        progress.note(f"training a BPE tokenizer of {vocab_size} tokens on {plural(len(files), 'file')}")
        return train_bpe(files, vocab_size, tok_path, max_bytes=bpe_train_bytes), TOKENIZER_FILE
    if not Path(spec).exists():
        raise DataError(f"unknown tokenizer {spec!r}: use 'byte', 'bpe' or a path to a tokenizer.json")
    src = HFTokenizer(spec, eos_token=eos_token)
    if src.path.resolve() != tok_path.resolve():
        _copy_tokenizer_files(src.path.parent, out_dir)
        tmp_tok = out_dir / f".{TOKENIZER_FILE}.tmp-{os.getpid()}"
        shutil.copyfile(src.path, tmp_tok)
        os.replace(tmp_tok, tok_path)
    return HFTokenizer(tok_path, eos_token=src.eos_token), TOKENIZER_FILE


def _copy_tokenizer_files(source: Path | None, out_dir: Path) -> None:
    """Make out_dir's tokenizer companion files those of `source` (none when None): an earlier
    preparation's must not describe another tokenizer."""
    for name in COMPANIONS:
        (out_dir / name).unlink(missing_ok=True)
    for name, text in (companion_files(source) if source is not None else {}).items():
        (out_dir / name).write_text(text, encoding="utf-8")


def _flush(files: list[Any], parts: list[list[np.ndarray]]) -> int:
    for f, arrays in zip(files, parts, strict=False):  # (no mask file: the masks are not kept)
        f.write(np.concatenate(arrays).tobytes())
    return sum(x.size for x in parts[0])


def _write_tokens(
    documents: Iterator[Document],
    n_files: int,
    eos_id: int,
    dtype: np.dtype,
    out_dir: Path,
    masked: bool,
    progress: Progress,
) -> dict[str, Any]:
    """Write `documents` into out_dir's tokens.bin (each followed by eos) and, if `masked`, their loss
    masks into loss_mask.bin (the eos separators do not count), atomically; returns the counts
    meta.json records."""
    names = [TOKENS_FILE, LOSS_MASK_FILE] if masked else [TOKENS_FILE]
    tmp = [out_dir / f".{name}.tmp-{os.getpid()}" for name in names]
    n_tokens = n_docs = buffered = 0
    sources: list[str] = []
    parts: list[list[np.ndarray]] = [[], []]  # token ids, loss masks
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(t, "wb")) for t in tmp]
            for files_done, source, ids, mask in documents:
                progress.update(files_done, n_tokens + buffered)
                parts[0] += [ids, np.asarray([eos_id], dtype=dtype)]
                if masked:
                    parts[1] += [mask, np.zeros(1, np.uint8)]
                buffered += ids.size + 1
                n_docs += 1
                if not sources or sources[-1] != source:
                    sources.append(source)
                if buffered >= _FLUSH_TOKENS:
                    n_tokens += _flush(files, parts)
                    parts, buffered = [[], []], 0
            if buffered:
                n_tokens += _flush(files, parts)
        progress.update(n_files, n_tokens)
        progress.close()
        if n_tokens:
            for t, name in zip(tmp, names, strict=True):
                _fsync_replace(t, out_dir / name)
            if not masked:
                (out_dir / LOSS_MASK_FILE).unlink(missing_ok=True)
    finally:
        for t in tmp:
            t.unlink(missing_ok=True)
    return {"n_tokens": n_tokens, "sources": sources, "n_documents": n_docs}


def _checked_inputs(
    inputs: Sequence[str | Path], out_dir: Path, tokenizer: str, chat: bool
) -> tuple[list[Path], list[str]]:
    """(files, Hugging Face datasets) of `inputs`, refused with the fix when they cannot be prepared as
    asked; creates `out_dir`."""
    if chat and tokenizer in ("byte", "bpe"):
        raise DataError(
            "--chat renders conversations with a tokenizer's chat template: pass --tokenizer PATH "
            "to a checkpoint's tokenizer.json (the chat template sits beside it)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    datasets = [str(i) for i in inputs if is_dataset_input(i)]
    files = collect_files([i for i in inputs if not is_dataset_input(i)], exclude=[out_dir])
    if not files and not datasets:
        raise DataError(f"no input files found in {[str(i) for i in inputs]}")
    if datasets and (chat or tokenizer == "bpe"):
        raise DataError(
            "Hugging Face datasets are read as text with a given tokenizer: pass --tokenizer byte "
            "or a tokenizer.json (a BPE is trained on files; --chat reads .jsonl files)"
        )
    return files, datasets


def prepare_data(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    *,
    eos_token: str | None = None,
    bpe_train_bytes: int | None = DEFAULT_BPE_TRAIN_BYTES,
    progress: bool | None = None,
    chat: bool = False,
    split: str = "train",
    text_field: str = "text",
    workers: int = 1,
) -> PreparedData:
    """Tokenize text/.jsonl/.parquet files and directories into ``out_dir``; returns the opened dataset.

    ``tokenizer`` is ``"byte"``, ``"bpe"`` (train a byte-level BPE of ``vocab_size`` on the corpus) or a
    path to a tokenizer.json (copied into ``out_dir``). ``vocab_size`` only matters for ``"bpe"``.
    ``progress``: show files, tokens and tokens/s on stderr as it goes (None: when stderr is a terminal).
    Inputs may also be Hugging Face datasets (data/hf_datasets.py: ``hf:NAME``, a ``save_to_disk``
    directory, ``.arrow`` or ``.json`` files), read as ``split`` and ``text_field``. ``workers`` > 1
    tokenizes in that many processes (data/encode.py; the same tokens in the same order).
    ``chat``: the inputs are .jsonl conversations, rendered with the tokenizer's chat template, and only
    the assistant turns count in the loss (data/chat.py: a loss_mask.bin beside the tokens).
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    files, datasets = _checked_inputs(inputs, out_dir, tokenizer, chat)
    meta_path = out_dir / META_FILE
    # Drop the completion marker first: a crash from here on must leave a dataset that refuses to open,
    # not an old meta.json describing new tokens.
    meta_path.unlink(missing_ok=True)
    shown = Progress(len(files), live=progress)
    tok, tok_spec = _dataset_tokenizer(
        tokenizer, files, out_dir, vocab_size, eos_token, bpe_train_bytes, shown
    )
    dtype = dtype_for_vocab(tok.vocab_size)
    if chat:
        documents = chat_documents(files, ChatTemplate(tokenizer), dtype)
    else:
        texts = text_documents(files, datasets, split, text_field)
        documents = encoded(texts, tok, str(tok.path) if tok_spec != "byte" else "byte", dtype, workers)
    counts = _write_tokens(documents, len(files) + len(datasets), tok.eos_id, dtype, out_dir, chat, shown)
    if counts["n_tokens"] == 0:
        raise DataError(f"inputs {[str(i) for i in inputs]} contain no text")
    meta = {
        "n_tokens": counts["n_tokens"],
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": tok_spec,
        "sources": counts["sources"],
        "n_documents": counts["n_documents"],
        **({"loss_mask": LOSS_MASK_FILE} if chat else {}),
    }
    tmp_meta = out_dir / f".{META_FILE}.tmp-{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    _fsync_replace(tmp_meta, meta_path)
    logger.info(
        "prepared %d tokens from %d documents (%s, vocab %d) into %s in %.1fs",
        meta["n_tokens"],
        meta["n_documents"],
        tok_spec,
        tok.vocab_size,
        out_dir,
        time.perf_counter() - t0,
    )
    return PreparedData.open(out_dir)


def default_dataset(
    cache_dir: str | Path | None = None,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    say: Callable[[str], None] | None = None,
) -> PreparedData:
    """The stdlib corpus, prepared on first use and cached; safe to call from several processes at once.
    `say` is told, in one line, when it has to be built (which takes a while)."""
    cache = Path(cache_dir) if cache_dir is not None else meshtron_cache_dir()
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer == "byte":
        tag = "byte"
    elif tokenizer == "bpe":
        tag = f"bpe{vocab_size}"
    else:
        # A given tokenizer.json is identified by content so editing it invalidates the cache.
        tok_file = HFTokenizer(tokenizer).path
        tag = "tok" + hashlib.sha256(tok_file.read_bytes()).hexdigest()[:12]
    final = cache / f"stdlib-{py}-{tag}"
    try:
        return PreparedData.open(final)
    except DataError:
        if final.exists():
            logger.warning("cached dataset %s is unusable; rebuilding it", final)

    files = stdlib_files()
    if say is not None:
        how = {"byte": "byte tokens", "bpe": f"a BPE of {vocab_size} tokens"}.get(tokenizer, tokenizer)
        say(f"building the default corpus ({len(files)} stdlib files, {how}) in {final}; cached after")
    cache.mkdir(parents=True, exist_ok=True)
    # Building in a private directory and renaming it into place is atomic: readers see either nothing or
    # a complete dataset, and concurrent builders cannot interleave writes.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        prepare_data(files, tmp, tokenizer=tokenizer, vocab_size=vocab_size)
        # mkdtemp makes the directory owner-only; a shared cache should be readable like any other.
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Either another process won the race (fine, use theirs) or a broken copy sits there.
            try:
                return PreparedData.open(final)
            except DataError:
                trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.broken-", dir=cache))
                os.rename(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.open(final)
