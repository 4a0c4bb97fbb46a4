import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, default_dataset, dtype_for_vocab, prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

CORPUS = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "The quick brown fox jumps over the lazy dog. Über café naïve résumé.\n"
)


def _write_corpus(d: Path, n_files: int = 4) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        p = d / f"f{i}.txt"
        p.write_text(CORPUS * (5 + i) + f"file {i}\n", encoding="utf-8")
        files.append(p)
    return files


def _wordlevel_tokenizer(path: Path, n_words: int, eos: str | None) -> Path:
    vocab = {f"w{i}": i for i in range(n_words)}
    vocab["[UNK]"] = n_words
    if eos is not None:
        vocab[eos] = n_words + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if eos is not None:
        tok.add_special_tokens([eos])
    tok.save(str(path))
    return path


def _tokens_dataset(tmp_path: Path, n_tokens: int) -> PreparedData:
    """A byte dataset whose token at position i is i % 251, so windows are recognisable."""
    out = tmp_path / "ds"
    out.mkdir()
    tokens = (np.arange(n_tokens) % 251).astype(np.uint16)
    tokens.tofile(out / "tokens.bin")
    meta = {"n_tokens": n_tokens, "dtype": "uint16", "vocab_size": 257, "eos_id": 256, "tokenizer": "byte"}
    (out / "meta.json").write_text(json.dumps(meta | {"sources": [], "n_documents": 1}))
    return PreparedData.open(out)


# ---------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld 😀 日本\n\t"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert ids[:3] == [104, 0xC3, 0xA9]
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([104, 105, 256, 106]) == "hi<|endoftext|>j"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_bpe_train_deterministic_and_round_trip(tmp_path):
    files = _write_corpus(tmp_path / "c")
    a = train_bpe(files, 320, tmp_path / "a" / "tokenizer.json")
    b = train_bpe(files, 320, tmp_path / "b" / "tokenizer.json")
    assert a.path.read_bytes() == b.path.read_bytes()
    assert 257 < a.vocab_size <= 320
    assert a.eos_token == "<|endoftext|>"
    assert a.eos_id == b.eos_id == 0
    text = "class Point:\n    def  x(self):  # 😀 unseen ✓ \r\n"
    ids = a.encode(text)
    assert ids == b.encode(text)
    assert a.decode(ids) == text
    # Merges were learned: common words are shorter than their bytes.
    assert len(a.encode("return self")) < len(b"return self")
    # A literal eos string in a document is text, not an end-of-document marker.
    lit = a.encode("x<|endoftext|>y")
    assert a.eos_id not in lit
    assert a.decode(lit) == "x<|endoftext|>y"
    with pytest.raises(ValueError, match="257"):
        train_bpe(files, 100, tmp_path / "c.json")


def test_load_tokenizer_json(tmp_path):
    p = _wordlevel_tokenizer(tmp_path / "tokenizer.json", 10, "</s>")
    tok = load_tokenizer(str(p))
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.eos_token) == (12, 11, "</s>")
    assert tok.encode("w3 w7 nope") == [3, 7, 10]
    # A directory holding tokenizer.json is accepted too.
    assert load_tokenizer(tmp_path).eos_id == 11
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="prepare_data"):
        load_tokenizer("bpe")
    with pytest.raises(DataError, match="unknown tokenizer"):
        load_tokenizer(tmp_path / "missing.json")


def test_tokenizer_without_eos_is_an_error(tmp_path):
    p = _wordlevel_tokenizer(tmp_path / "noeos.json", 10, None)
    with pytest.raises(DataError, match=r"add_special_tokens\(\['<\|endoftext\|>'\]\)"):
        HFTokenizer(p)
    q = _wordlevel_tokenizer(tmp_path / "custom.json", 10, "<END>")
    assert HFTokenizer(q, eos_token="<END>").eos_id == 11


# ---------------------------------------------------------------------------- prepare_data


def test_prepare_byte_text_and_directories(tmp_path):
    src = tmp_path / "src"
    (src / "b_sub").mkdir(parents=True)
    (src / "z.md").write_text("zz")
    (src / "a.py").write_text("é")
    (src / "b_sub" / "c.txt").write_text("c")
    (src / ".hidden").write_text("skip me")
    (src / "blob.bin").write_bytes(b"\x00\x01\x02")
    (src / "empty.txt").write_text("")
    extra = tmp_path / "extra.txt"
    extra.write_text("X")
    ds = prepare_data([extra, src], tmp_path / "out")
    expected = [ord("X"), 256, 0xC3, 0xA9, 256, ord("c"), 256, ord("z"), ord("z"), 256]
    assert ds.tokens.tolist() == expected
    assert ds.tokens.dtype == np.uint16
    assert (ds.n_tokens, ds.n_documents, ds.vocab_size, ds.eos_id) == (10, 4, 257, 256)
    assert [Path(s).name for s in ds.sources] == ["extra.txt", "a.py", "c.txt", "z.md"]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["dtype"] == "uint16" and meta["n_tokens"] == 10
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "tokens.bin"]
    assert not ds.tokens.flags.writeable
    assert isinstance(ds.load_tokenizer(), ByteTokenizer)


def test_prepare_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ab", "id": 1}\n\n{"text": "ç"}\n{"text": ""}\n', encoding="utf-8")
    ds = prepare_data([p], tmp_path / "out")
    assert ds.tokens.tolist() == [97, 98, 256, 0xC3, 0xA7, 256]
    assert ds.n_documents == 2


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"text": "a"}', '{"text": "b"}', "{not json"], r"bad\.jsonl:3: invalid JSON"),
        (['{"text": "a"}', '{"content": "b"}'], r'bad\.jsonl:2: expected a JSON object with a "text" key'),
        (['{"text": 5}'], r'bad\.jsonl:1: "text" must be a string'),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, match):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=match):
        prepare_data([p], tmp_path / "out")


def _parquet(path: Path, column: str, values: list) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: values}), path, row_group_size=2)  # several row groups
    return path


def test_prepare_parquet(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _parquet(src / "a.parquet", "text", ["ab", None, "", "ç", "d"])
    (src / "b.txt").write_text("e")
    ds = prepare_data([src], tmp_path / "out")  # a directory keeps its Parquet files (binary as they are)
    assert ds.tokens.tolist() == [97, 98, 256, 0xC3, 0xA7, 256, 100, 256, 101, 256]
    assert ds.n_documents == 4 and [Path(s).name for s in ds.sources] == ["a.parquet", "b.txt"]
    with pytest.raises(DataError, match=r'no_text\.parquet: expected a "text" column; it has body'):
        prepare_data([_parquet(tmp_path / "no_text.parquet", "body", ["x"])], tmp_path / "o2")
    with pytest.raises(DataError, match=r'ints\.parquet: the "text" column must hold strings, it holds int'):
        prepare_data([_parquet(tmp_path / "ints.parquet", "text", [1, 2])], tmp_path / "o3")


def test_parquet_without_pyarrow_is_a_clear_error_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1 stands in for a Parquet file PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what `import pyarrow` sees when it is missing
    with pytest.raises(DataError, match=r"needs pyarrow.*pip install 'meshtron\[parquet\]'"):
        prepare_data([tmp_path], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prepare_shows_progress_on_a_terminal_and_is_quiet_in_a_log(tmp_path, monkeypatch, capsys):
    files = _write_corpus(tmp_path / "c")
    ds = prepare_data(files, tmp_path / "log")  # pytest's stderr is no terminal, as a log file is not
    assert capsys.readouterr().err == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    again = prepare_data(files, tmp_path / "tty", tokenizer="bpe", vocab_size=300)
    shown = terminal.getvalue()
    assert shown.startswith("training a BPE tokenizer of 300 tokens on 4 files\n")
    assert shown.count("\r") >= 2 and shown.endswith("\n")  # rewritten in place, then the line ended
    last = shown.rsplit("\r", 1)[1]
    assert last.startswith(f"tokenizing: 4/4 files, {again.n_tokens:,} tokens, ") and "tokens/s" in last
    assert ds.n_tokens > again.n_tokens  # the BPE run did tokenize (fewer tokens than bytes)


def test_failed_prepare_never_leaves_a_complete_looking_dataset(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("hello")
    out = tmp_path / "out"
    assert prepare_data([good], out).n_tokens == 6
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        prepare_data([good, bad], out)
    with pytest.raises(DataError, match="incomplete"):
        PreparedData.open(out)
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_dtype_choice_uint16_vs_uint32(tmp_path):
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    tj = _wordlevel_tokenizer(tmp_path / "big.json", 70000, "</s>")
    text = tmp_path / "t.txt"
    text.write_text("w69999 w5 w65536")
    ds = prepare_data([text], tmp_path / "out", tokenizer=str(tj))
    assert ds.tokens.dtype == np.uint32
    assert ds.tokens.tolist() == [69999, 5, 65536, 70001]
    assert ds.vocab_size == 70002
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["tokenizer"] == "tokenizer.json"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tj.read_bytes()
    assert ds.load_tokenizer().decode([69999, 5]) == "w69999 w5"


def test_prepare_bpe_copies_tokenizer(tmp_path):
    files = _write_corpus(tmp_path / "c", n_files=2)
    ds = prepare_data(files, tmp_path / "out", tokenizer="bpe", vocab_size=300)
    tok = ds.load_tokenizer()
    assert ds.tokenizer_path == tmp_path / "out" / "tokenizer.json"
    assert ds.n_documents == 2 and ds.eos_id == tok.eos_id == 0
    ids = ds.tokens.tolist()
    cut = ids.index(ds.eos_id)
    assert tok.decode(ids[:cut]) == files[0].read_text()
    assert ids[-1] == ds.eos_id and ids.count(ds.eos_id) == 2


def test_open_validation_errors(tmp_path):
    with pytest.raises(DataError, match="no prepared dataset.*prepare-data"):
        PreparedData.open(tmp_path / "nope")
    f = tmp_path / "a.txt"
    f.write_text("abcdef")
    out = tmp_path / "out"
    prepare_data([f], out)
    meta = json.loads((out / "meta.json").read_text())

    with open(out / "tokens.bin", "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(DataError, match="16 bytes but meta.json says 7 uint16 tokens"):
        PreparedData.open(out)
    prepare_data([f], out)

    (out / "meta.json").write_text(json.dumps(meta | {"dtype": "int8"}))
    with pytest.raises(DataError, match="dtype 'int8'"):
        PreparedData.open(out)
    (out / "meta.json").write_text(json.dumps(meta | {"vocab_size": 100000}))
    with pytest.raises(DataError, match="cannot hold vocab_size 100000"):
        PreparedData.open(out)
    (out / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(DataError, match="malformed"):
        PreparedData.open(out)
    (out / "meta.json").write_text(json.dumps(meta | {"tokenizer": "tokenizer.json"}))
    with pytest.raises(DataError, match="tokenizer.json.*missing"):
        PreparedData.open(out)
    (out / "meta.json").write_text(json.dumps(meta))
    assert PreparedData.open(out).tokens.tolist() == [97, 98, 99, 100, 101, 102, 256]
    (out / "tokens.bin").unlink()
    with pytest.raises(DataError, match="tokens.bin is missing"):
        PreparedData.open(out)


# ---------------------------------------------------------------------------- sampler


def test_sampler_windows_and_determinism(tmp_path):
    ds = _tokens_dataset(tmp_path, 1000)
    s = BatchSampler(ds.n_tokens, seq_len=9, global_batch=4, seed=7)
    assert s.n_windows == 100
    idx = s.global_indices(3)
    assert idx.tolist() == BatchSampler(1000, 9, 4, 7).global_indices(3).tolist()
    assert idx.tolist() != BatchSampler(1000, 9, 4, 8).global_indices(3).tolist()
    x, y = s.rank_batch(ds, 3, 0, 1)
    assert x.dtype == torch.int64 and x.shape == (4, 9) and y.shape == (4, 9)
    for row, w in enumerate(idx.tolist()):
        window = [(w * 10 + j) % 251 for j in range(10)]
        assert x[row].tolist() == window[:-1]
        assert y[row].tolist() == window[1:]


def test_sampler_epochs_are_permutations_and_cross_boundaries():
    s = BatchSampler(n_tokens=10 * 8 + 5, seq_len=7, global_batch=4, seed=3)
    assert s.n_windows == 10 and s.steps_per_epoch == 2.5
    stream = np.concatenate([s.global_indices(k) for k in range(5)])
    epoch0, epoch1 = stream[:10], stream[10:]
    assert sorted(epoch0.tolist()) == list(range(10))
    assert sorted(epoch1.tolist()) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist()
    # Step 2 spans the end of epoch 0 and the start of epoch 1.
    assert s.global_indices(2).tolist() == epoch0[8:].tolist() + epoch1[:2].tolist()
    expected0 = np.random.default_rng([3, 0]).permutation(10)
    assert epoch0.tolist() == expected0.tolist()
    # Random access far ahead matches sequential iteration.
    fresh = BatchSampler(85, 7, 4, 3)
    assert fresh.global_indices(4).tolist() == stream[16:20].tolist()


def test_global_batch_independent_of_layout(tmp_path):
    ds = _tokens_dataset(tmp_path, 5000)
    s = BatchSampler(ds.n_tokens, seq_len=15, global_batch=12, seed=0)
    for step in (0, 5, 26):  # 312 windows -> step 26 crosses into epoch 1
        ref_x, ref_y = s.rank_batch(ds, step, 0, 1)
        for dp in (1, 2, 3, 4, 6, 12):
            parts = [s.rank_batch(ds, step, r, dp) for r in range(dp)]
            assert all(p[0].shape == (12 // dp, 15) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)


def test_micro_batches_split_rank_slice(tmp_path):
    ds = _tokens_dataset(tmp_path, 5000)
    s = BatchSampler(ds.n_tokens, seq_len=15, global_batch=12, seed=1)
    x, y = s.rank_batch(ds, 4, 1, 2)
    mbs = s.micro_batches(ds, 4, 1, 2, micro_batch=2)
    assert len(mbs) == 3
    assert all(m[0].shape == (2, 15) and m[1].shape == (2, 15) for m in mbs)
    assert torch.equal(torch.cat([m[0] for m in mbs]), x)
    assert torch.equal(torch.cat([m[1] for m in mbs]), y)


def test_divisibility_and_size_errors(tmp_path):
    ds = _tokens_dataset(tmp_path, 5000)
    s = BatchSampler(ds.n_tokens, seq_len=15, global_batch=12, seed=1)
    with pytest.raises(ValueError, match=r"not divisible by micro_batch\*dp = 1\*5"):
        s.rank_batch(ds, 0, 0, 5)
    with pytest.raises(ValueError, match=r"not divisible by micro_batch\*dp = 4\*2"):
        s.micro_batches(ds, 0, 0, 2, micro_batch=4)
    with pytest.raises(ValueError, match="dp_rank"):
        s.rank_batch(ds, 0, 2, 2)
    with pytest.raises(ValueError, match="holds 3 windows .* fewer than one global batch of 4"):
        BatchSampler(n_tokens=50, seq_len=15, global_batch=4, seed=0)
    with pytest.raises(ValueError, match="n_tokens"):
        BatchSampler(4000, 15, 12, 1).rank_batch(ds, 0, 0, 1)


def test_resume_from_state_dict(tmp_path):
    ds = _tokens_dataset(tmp_path, 5000)
    a = BatchSampler(ds.n_tokens, seq_len=15, global_batch=8, seed=5)
    for _ in range(3):
        a.next_micro_batches(ds, 1, 2, 2)
    state = a.state_dict()
    assert state == {"step": 3, "n_tokens": 5000, "seq_len": 15, "global_batch": 8, "seed": 5}
    state = json.loads(json.dumps(state))  # survives a JSON checkpoint
    b = BatchSampler(ds.n_tokens, seq_len=15, global_batch=8, seed=5)
    b.load_state_dict(state)
    for _ in range(50):  # crosses epochs (312 windows = 39 steps each)
        xa, ya = a.next_rank_batch(ds, 0, 2)
        xb, yb = b.next_rank_batch(ds, 0, 2)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.step == b.step == 53
    for key, bad in (("seq_len", 31), ("global_batch", 16), ("seed", 6), ("n_tokens", 4999)):
        with pytest.raises(ValueError, match=f"{key}={bad} but this run has {key}="):
            BatchSampler(5000, 15, 8, 5).load_state_dict(state | {key: bad})


# ---------------------------------------------------------------------------- default corpus


def test_default_dataset_builds_once_and_caches(tmp_path):
    said: list[str] = []
    ds = default_dataset(tmp_path, say=said.append)
    name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-bpe4096"
    assert ds.path == tmp_path / name
    assert os.listdir(tmp_path) == [name]  # no temp directories left behind
    assert ds.vocab_size == 4096 and ds.tokens.dtype == np.uint16
    assert ds.n_documents == len(ds.sources) > 100
    assert 500_000 < ds.n_tokens < 3_000_000
    tok = ds.load_tokenizer()
    ids = ds.tokens.tolist()
    cut = ids.index(ds.eos_id)
    assert tok.decode(ids[:cut]) == Path(ds.sources[0]).read_text(encoding="utf-8-sig")

    # The second call opens the cached copy: nothing in it is written again.
    mtimes = {f.name: f.stat().st_mtime_ns for f in ds.path.iterdir()}
    again = default_dataset(tmp_path, say=said.append)
    assert again.path == ds.path and again.n_tokens == ds.n_tokens
    # Building said so once, in one line; opening the cached copy says nothing.
    assert len(said) == 1 and said[0].startswith("building the default corpus (") and name in said[0]
    assert {f.name: f.stat().st_mtime_ns for f in ds.path.iterdir()} == mtimes
