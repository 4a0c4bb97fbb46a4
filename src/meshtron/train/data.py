"""Training data: tokenizers, on-disk token datasets, and a layout-independent batch sampler.

A prepared dataset is a directory holding one flat ``tokens.bin`` (documents joined, each followed by the
end-of-document token), a ``meta.json`` describing it and, for learned tokenizers, a ``tokenizer.json``.
``meta.json`` is written last and atomically, so its presence marks a complete dataset.

The sampler depends only on the token count and its own arguments, never on the parallel layout, so any
mix of data/tensor/pipeline parallelism (and any resume point) sees exactly the same global batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

logger = logging.getLogger(__name__)

EOS_TEXT = "<|endoftext|>"
# Ordered by how common they are in released tokenizers; the first one present becomes eos.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
# Bounds memory while writing: tokens are flushed to disk once this many are buffered.
_FLUSH_TOKENS = 1 << 20
# BPE merges converge long before a big corpus is exhausted; capping training keeps prepare-data fast.
DEFAULT_BPE_TRAIN_BYTES = 256 << 20

PREPARE_HINT = "run `meshtron prepare-data` (or meshtron.train.data.prepare_data) to (re)build it"


class DataError(ValueError):
    """A dataset or tokenizer is missing, malformed or inconsistent; the message says how to fix it."""


# --------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus eos 256: needs no files and never sees an unknown symbol."""

    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # eos is rendered like the BPE special token so samples from either tokenizer read the same.
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                out.append(buf.decode("utf-8", errors="replace") + EOS_TEXT)
                buf.clear()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary (0..256)")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / TOKENIZER_FILE
        if not self.path.is_file():
            raise DataError(f"tokenizer file {self.path} does not exist; pass a path to a tokenizer.json")
        try:
            self._tok = _HFTok.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a bare Exception for parse errors
            raise DataError(f"cannot load {self.path} as a tokenizers tokenizer.json: {e}") from e
        # Pretraining text is taken literally: a document that happens to contain "</s>" must not inject an
        # end-of-document mid-stream; eos is only ever inserted by prepare_data.
        self._tok.encode_special_tokens = True
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        found = [(c, i) for c in candidates if (i := self._tok.token_to_id(c)) is not None]
        if not found:
            looked = ", ".join(repr(c) for c in candidates)
            raise DataError(
                f"{self.path} has no end-of-document token (looked for {looked}); add one, e.g. "
                f"`tok.add_special_tokens(['{EOS_TEXT}']); tok.save(path)` with the tokenizers library, "
                "or pass eos_token= naming the special token it uses"
            )
        self.eos_token: str = found[0][0]
        self.eos_id: int = found[0][1]

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: BOS/EOS templates from a post-processor would double up with our eos.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def load_tokenizer(spec: str | Path, eos_token: str | None = None) -> Tokenizer:
    """``"byte"`` -> ByteTokenizer; a tokenizer.json (or a directory holding one) -> HFTokenizer."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if str(spec) == "bpe":
        raise DataError(
            "tokenizer 'bpe' is trained on the corpus: pass it to prepare_data / `meshtron prepare-data`, "
            "or call train_bpe(files, vocab_size, out_path) first and load the tokenizer.json it writes"
        )
    path = Path(spec)
    if not path.exists():
        raise DataError(f"unknown tokenizer {str(spec)!r}: use 'byte', 'bpe' or a path to a tokenizer.json")
    return HFTokenizer(path, eos_token=eos_token)


def train_bpe(
    files: Iterable[str | Path], vocab_size: int, out_path: str | Path, max_bytes: int | None = None
) -> HFTokenizer:
    """Train a byte-level BPE (special token ``<|endoftext|>``) on ``files`` and save it to ``out_path``.

    The result depends only on the file contents and order (verified deterministic across processes), so
    every rank of a job that trains its own copy gets the same tokenizer. ``max_bytes`` caps how much text
    is used for training; the caller still tokenizes everything with the result.
    """
    from tokenizers import Tokenizer as _HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"BPE vocab_size must be >= 257 (256 byte symbols + eos), got {vocab_size}")
    files = [Path(f) for f in files]
    tok = _HFTok(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly, which code corpora need.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        # All 256 byte symbols up front so text unseen in training still encodes (no unknown token needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        seen = 0
        for _, text in iter_documents(files):
            yield text
            seen += len(text.encode("utf-8"))
            if max_bytes is not None and seen >= max_bytes:
                return

    tok.train_from_iterator(texts(), trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out_path)
    return HFTokenizer(out_path, eos_token=EOS_TEXT)


# --------------------------------------------------------------------------------------------------------
# Reading corpora
# --------------------------------------------------------------------------------------------------------


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        return True
    if len(head) == 8192:
        # A multi-byte character cut at the read boundary must not make a text file look binary.
        head = head[:-3]
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def collect_files(inputs: Sequence[str | Path], exclude: Sequence[Path] = ()) -> list[Path]:
    """Expand ``inputs`` into files: files as given, directories recursively in sorted order.

    Inside directories, hidden entries (``.git`` ...) and binary-looking files are skipped so that pointing
    at a source tree just works; a file named explicitly is always read (and fails loudly if not text).
    """
    excluded = {p.resolve() for p in exclude}
    out: list[Path] = []
    for inp in inputs:
        p = Path(inp)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found: list[Path] = []
            for root, dirs, files in os.walk(p):
                rootp = Path(root)
                dirs[:] = [d for d in dirs if not d.startswith(".") and (rootp / d).resolve() not in excluded]
                for name in files:
                    fp = rootp / name
                    if not name.startswith(".") and fp.is_file() and not _looks_binary(fp):
                        found.append(fp)
            # Sorting by relative path (not walk order) makes the corpus order filesystem-independent.
            found.sort(key=lambda f: f.relative_to(p).as_posix())
            out.extend(found)
        else:
            raise DataError(f"input {p} does not exist")
    return out


def iter_documents(files: Iterable[Path]) -> Iterator[tuple[Path, str]]:
    """Yield ``(file, text)`` per document: one per text file, one per line of a ``.jsonl`` file."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8-sig") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{path}:{lineno}: invalid JSON ({e.msg}); fix or remove the line"
                        ) from e
                    if not isinstance(obj, dict) or "text" not in obj:
                        raise DataError(f'{path}:{lineno}: expected a JSON object with a "text" key')
                    if not isinstance(obj["text"], str):
                        raise DataError(
                            f'{path}:{lineno}: "text" must be a string, got {type(obj["text"]).__name__}'
                        )
                    if obj["text"]:
                        yield path, obj["text"]
        else:
            try:
                # utf-8-sig drops a BOM so it does not become a token at the start of the document.
                text = path.read_text(encoding="utf-8-sig")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text ({e}); convert it or leave it out") from e
            if text:
                yield path, text


# --------------------------------------------------------------------------------------------------------
# Prepared datasets
# --------------------------------------------------------------------------------------------------------


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every token id: halves disk and page cache for vocabularies <= 64K."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


@dataclass
class PreparedData:
    """A prepared dataset directory with its tokens memory-mapped read-only."""

    path: Path
    tokens: np.ndarray
    vocab_size: int
    eos_id: int
    tokenizer_spec: str
    n_documents: int
    sources: list[str] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.n_tokens

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
        return cls(
            path=path,
            tokens=tokens,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer_spec=tok_spec,
            n_documents=int(meta.get("n_documents", 0)),
            sources=list(meta.get("sources", [])),
        )


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def prepare_data(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    *,
    eos_token: str | None = None,
    bpe_train_bytes: int | None = DEFAULT_BPE_TRAIN_BYTES,
) -> PreparedData:
    """Tokenize text/.jsonl files and directories into ``out_dir``; returns the opened dataset.

    ``tokenizer`` is ``"byte"``, ``"bpe"`` (train a byte-level BPE of ``vocab_size`` on the corpus) or a
    path to a tokenizer.json (copied into ``out_dir``). ``vocab_size`` only matters for ``"bpe"``.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = collect_files(inputs, exclude=[out_dir])
    if not files:
        raise DataError(f"no input files found in {[str(i) for i in inputs]}")
    meta_path, tokens_path, tok_path = out_dir / META_FILE, out_dir / TOKENS_FILE, out_dir / TOKENIZER_FILE
    # Drop the completion marker first: a crash from here on must leave a dataset that refuses to open,
    # not an old meta.json describing new tokens.
    meta_path.unlink(missing_ok=True)

    tok: Tokenizer
    if tokenizer == "byte":
        tok = ByteTokenizer()
        tok_path.unlink(missing_ok=True)
        tok_spec = "byte"
    elif tokenizer == "bpe":
        tok = train_bpe(files, vocab_size, tok_path, max_bytes=bpe_train_bytes)
        tok_spec = TOKENIZER_FILE
    else:
        if not Path(tokenizer).exists():
            raise DataError(
                f"unknown tokenizer {tokenizer!r}: use 'byte', 'bpe' or a path to a tokenizer.json"
            )
        src = HFTokenizer(tokenizer, eos_token=eos_token)
        if src.path.resolve() != tok_path.resolve():
            tmp_tok = out_dir / f".{TOKENIZER_FILE}.tmp-{os.getpid()}"
            shutil.copyfile(src.path, tmp_tok)
            os.replace(tmp_tok, tok_path)
        tok = HFTokenizer(tok_path, eos_token=src.eos_token)
        tok_spec = TOKENIZER_FILE

    dtype = dtype_for_vocab(tok.vocab_size)
    tmp_tokens = out_dir / f".{TOKENS_FILE}.tmp-{os.getpid()}"
    n_tokens = n_docs = 0
    sources: list[str] = []
    try:
        with open(tmp_tokens, "wb") as f:
            buf: list[np.ndarray] = []
            buffered = 0
            for path, text in iter_documents(files):
                ids = np.asarray(tok.encode(text), dtype=dtype)
                buf.append(ids)
                buf.append(np.asarray([tok.eos_id], dtype=dtype))
                buffered += ids.size + 1
                n_docs += 1
                # Absolute, so meta.json still says where the data came from when read from elsewhere.
                src_name = str(path.resolve())
                if not sources or sources[-1] != src_name:
                    sources.append(src_name)
                if buffered >= _FLUSH_TOKENS:
                    f.write(np.concatenate(buf).tobytes())
                    n_tokens += buffered
                    buf, buffered = [], 0
            if buf:
                f.write(np.concatenate(buf).tobytes())
                n_tokens += buffered
        if n_tokens == 0:
            raise DataError(f"inputs {[str(i) for i in inputs]} contain no text")
        _fsync_replace(tmp_tokens, tokens_path)
    finally:
        tmp_tokens.unlink(missing_ok=True)

    meta = {
        "n_tokens": n_tokens,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": tok_spec,
        "sources": sources,
        "n_documents": n_docs,
    }
    tmp_meta = out_dir / f".{META_FILE}.tmp-{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    _fsync_replace(tmp_meta, meta_path)
    logger.info(
        "prepared %d tokens from %d documents (%s, vocab %d) into %s in %.1fs",
        n_tokens,
        n_docs,
        tok_spec,
        tok.vocab_size,
        out_dir,
        time.perf_counter() - t0,
    )
    return PreparedData.open(out_dir)


# --------------------------------------------------------------------------------------------------------
# Default offline corpus: the Python standard library's source
# --------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    env = os.environ.get("MESHTRON_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meshtron"


def stdlib_files() -> list[Path]:
    """Top-level ``*.py`` of this interpreter's standard library, sorted by name (~170 files, ~4.7 MB)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in stdlib.glob("*.py") if p.is_file()), key=lambda p: p.name)
    if not files:
        raise DataError(f"no *.py files in the standard library dir {stdlib}; prepare your own data instead")
    return files


def default_dataset(
    cache_dir: str | Path | None = None, tokenizer: str = "bpe", vocab_size: int = 4096
) -> PreparedData:
    """The stdlib corpus, prepared on first use and cached; safe to call from several processes at once."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
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

    cache.mkdir(parents=True, exist_ok=True)
    # Building in a private directory and renaming it into place is atomic: readers see either nothing or
    # a complete dataset, and concurrent builders cannot interleave writes.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        prepare_data(stdlib_files(), tmp, tokenizer=tokenizer, vocab_size=vocab_size)
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


# --------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------


Batch = tuple[torch.Tensor, torch.Tensor]


class BatchSampler:
    """Deterministic, resumable global batches of non-overlapping ``seq_len + 1`` token windows.

    Window ``w`` covers tokens ``[w*(seq_len+1), (w+1)*(seq_len+1))``. Epoch ``e`` visits all windows in the
    permutation drawn from ``default_rng([seed, e])``; the epochs are concatenated into one stream and step
    ``s`` takes stream positions ``[s*global_batch, (s+1)*global_batch)``. Data-parallel ranks take
    contiguous slices of that batch, so the global batch never depends on the layout.
    """

    def __init__(self, n_tokens: int, seq_len: int, global_batch: int, seed: int) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy SeedSequence requirement), got {seed}")
        self.n_tokens = int(n_tokens)
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.n_windows = self.n_tokens // (self.seq_len + 1)
        if self.n_windows < self.global_batch:
            raise ValueError(
                f"the corpus ({self.n_tokens} tokens) holds {self.n_windows} windows of seq_len+1="
                f"{self.seq_len + 1} tokens, fewer than one global batch of {self.global_batch}; use more "
                "data, a shorter seq_len or a smaller global batch"
            )
        self.step = 0  # next step the next_* helpers will return; this is all a resume needs
        # Permutations are O(n_windows) to draw; a step touches at most two epochs, so two suffice.
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.n_windows / self.global_batch

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of the global batch at ``step`` (length global_batch)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.n_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def _check(self, dataset: PreparedData, dp_rank: int, dp_size: int) -> None:
        if dataset.n_tokens != self.n_tokens:
            raise ValueError(
                f"sampler was built for {self.n_tokens} tokens but the dataset at {dataset.path} has "
                f"{dataset.n_tokens}; build the sampler from this dataset's n_tokens"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if self.global_batch % dp_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by dp_size {dp_size}; choose a global "
                f"batch that is a multiple of {dp_size}"
            )

    def rank_batch(self, dataset: PreparedData, step: int, dp_rank: int, dp_size: int) -> Batch:
        """``(inputs, targets)`` int64 ``[global_batch // dp_size, seq_len]``: this rank's contiguous slice."""
        self._check(dataset, dp_rank, dp_size)
        per = self.global_batch // dp_size
        windows = self.global_indices(step)[dp_rank * per : (dp_rank + 1) * per]
        span = self.seq_len + 1
        idx = windows[:, None] * span + np.arange(span, dtype=np.int64)[None, :]
        block = torch.from_numpy(np.asarray(dataset.tokens[idx], dtype=np.int64))
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    def micro_batches(
        self, dataset: PreparedData, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        """This rank's slice split into ``global_batch // (dp_size * micro_batch)`` micro-batches."""
        if micro_batch < 1 or self.global_batch % (dp_size * micro_batch):
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by dp_size*micro_batch = "
                f"{dp_size}*{micro_batch}; pick global_batch as a multiple of {dp_size * max(micro_batch, 1)} "
                "or a micro_batch that divides global_batch/dp_size"
            )
        inputs, targets = self.rank_batch(dataset, step, dp_rank, dp_size)
        return list(zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True))

    def next_rank_batch(self, dataset: PreparedData, dp_rank: int, dp_size: int) -> Batch:
        batch = self.rank_batch(dataset, self.step, dp_rank, dp_size)
        self.step += 1
        return batch

    def next_micro_batches(
        self, dataset: PreparedData, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        batches = self.micro_batches(dataset, self.step, dp_rank, dp_size, micro_batch)
        self.step += 1
        return batches

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "n_tokens": self.n_tokens,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_tokens", "seq_len", "global_batch", "seed"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; it is not a BatchSampler state_dict")
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"checkpointed sampler has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resume with the same dataset and data config, or start a fresh run"
                )
        step = int(state.get("step", -1))
        if step < 0:
            raise ValueError(f"sampler state has invalid step {state.get('step')!r}")
        self.step = step
