"""prepare-data from Hugging Face datasets (issue 32.4): a save_to_disk directory (and a split of a
DatasetDict), an Arrow file and a JSON file through `datasets` give exactly the tokens of the same texts
in a .jsonl file; --text-field picks the column; --workers N tokenizes in N processes to the same bytes;
bad inputs are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, prepare_data

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [path.read_text() for path in sorted((ROOT / "src" / "meshtron" / "data").glob("*.py"))]


def tokens(path: Path) -> np.ndarray:
    return np.asarray(PreparedData.open(path).tokens)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """(a working directory, the tokens of TEXTS prepared from a .jsonl file with bytes)."""
    tmp = tmp_path_factory.mktemp("hfdata")
    (tmp / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare_data([tmp / "texts.jsonl"], tmp / "from-jsonl", tokenizer="byte")
    return tmp, tokens(tmp / "from-jsonl")


def test_datasets_inputs_give_the_tokens_of_the_same_texts(reference):
    tmp, want = reference
    table = datasets.Dataset.from_dict({"body": TEXTS, "id": list(range(len(TEXTS)))})
    table.save_to_disk(str(tmp / "saved"))
    datasets.DatasetDict({"train": table.select([0]), "validation": table}).save_to_disk(str(tmp / "dict"))
    (tmp / "rows.json").write_text(json.dumps([{"body": t} for t in TEXTS]))
    cases = {
        "saved": (tmp / "saved", "train"),
        "dict": (tmp / "dict", "validation"),
        "arrow": (next((tmp / "saved").glob("*.arrow")), "train"),
        "json": (tmp / "rows.json", "train"),
    }
    for name, (source, split) in cases.items():
        out = tmp / f"from-{name}"
        prepare_data([source], out, tokenizer="byte", split=split, text_field="body")
        assert np.array_equal(tokens(out), want), name


def test_workers_give_the_same_tokens(reference, tmp_path):
    tmp, want = reference
    prepare_data([tmp / "texts.jsonl"], tmp_path / "two", tokenizer="byte", workers=2)
    assert np.array_equal(tokens(tmp_path / "two"), want)


def test_bad_dataset_inputs_are_refused_by_name(reference, tmp_path):
    tmp, _ = reference
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match="no column 'text'.*--text-field"):
        prepare_data([tmp_path / "saved"], tmp_path / "out", tokenizer="byte")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "d")
    )
    with pytest.raises(DataError, match="no split 'test'"):
        prepare_data([tmp_path / "d"], tmp_path / "out", tokenizer="byte", split="test")
    with pytest.raises(DataError, match="given tokenizer"):
        prepare_data([tmp_path / "saved"], tmp_path / "out", tokenizer="bpe", text_field="body")
