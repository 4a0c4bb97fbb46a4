"""Tokenizers: UTF-8 bytes, any Hugging Face `tokenizer.json`, and a byte-level BPE trained on a corpus."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from meshtron.data import DataError
from meshtron.data.corpus import iter_documents

EOS_TEXT = "<|endoftext|>"
# Ordered by how common they are in released tokenizers; the first one present becomes eos.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"


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


def _byte_symbols() -> list[str]:
    """The printable character byte-level tokenizers (GPT-2's, `tokenizers`' ByteLevel) write for each
    byte value 0..255: printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def tokenizer_json(tok: Tokenizer) -> str:
    """`tok` as a Hugging Face tokenizer.json (what checkpoints carry and `meshtron export` converts):
    an HFTokenizer's own file, or for bytes a byte-level model with no merges whose ids are the byte
    values and eos 256, so it encodes and decodes exactly as ByteTokenizer does."""
    if isinstance(tok, HFTokenizer):
        return tok.path.read_text(encoding="utf-8")
    if not isinstance(tok, ByteTokenizer):
        raise TypeError(f"no tokenizer.json for {tok!r}")
    from tokenizers import Tokenizer as _HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    hf = _HFTok(models.BPE(vocab=vocab, merges=[]))
    # No regex split: bytes are tokens whatever the text, as ByteTokenizer has it.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOS_TEXT])
    return hf.to_str()


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
