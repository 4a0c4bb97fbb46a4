"""Loss masks and chat data (issue 32.2): `prepare-data --chat` renders conversations with the tokenizer's
own chat template and counts only assistant turns; the loss is divided by the targets that count over the
whole global batch, so every layout (dp with accumulation, cp, pp, tp) matches one device, and the first
loss equals transformers' with labels -100 on the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtron.data import IGNORE_INDEX, DataError
from meshtron.data.dataset import PreparedData, prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.data.tokenizer import train_bpe
from meshtron.testing.parity import assert_losses_match, run_layout, val_losses
from meshtron.testing.tiny import TINY

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = ["What is a mesh?", "Name a parallelism.", "Why shard optimizer state?", "What is a bubble?"]
ANSWERS = ["Ranks in a grid.", "Tensor parallel.", "To fit bigger models.", "Idle pipeline time."]


def chat_tokenizer(folder: Path, texts: list[Path]) -> Path:
    """A byte-level BPE with ChatML's special tokens and a tokenizer_config.json holding the template."""
    from tokenizers import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    train_bpe(texts, 300, path)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def conversation(i: int) -> dict:
    q, a = QUESTIONS[i % 4], ANSWERS[i % 4]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]
    messages.append({"role": "assistant", "content": f"{a} ({i})"})
    if i % 2:  # a second exchange in every other conversation
        messages += [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "No more."}]
    return {"messages": messages}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[Path, Path]:
    """(prepared chat dataset, its tokenizer.json): 300 conversations."""
    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "text.txt").write_text(" ".join(QUESTIONS + ANSWERS) * 20)
    tokenizer = chat_tokenizer(tmp / "tok", [tmp / "text.txt"])
    rows = "\n".join(json.dumps(conversation(i)) for i in range(300))
    (tmp / "chats.jsonl").write_text(rows + "\n")
    prepare_data([tmp / "chats.jsonl"], tmp / "prepared", tokenizer=str(tokenizer), chat=True)
    return tmp / "prepared", tokenizer


def test_only_assistant_turns_count(chat_data):
    """The counted tokens of each conversation decode to its assistant turns with their end marks."""
    from tokenizers import Tokenizer

    data = PreparedData.open(chat_data[0])
    tok = Tokenizer.from_file(str(chat_data[1]))
    tokens, mask = np.asarray(data.tokens), np.asarray(data.loss_mask)
    ends = np.flatnonzero(tokens == data.eos_id)
    assert len(ends) == data.n_documents == 300 and not mask[ends].any()  # separators do not count
    start = 0
    for i, end in enumerate(ends[:6]):
        counted = tok.decode(tokens[start:end][mask[start:end] == 1].tolist(), skip_special_tokens=False)
        turns = [m["content"] for m in conversation(i)["messages"] if m["role"] == "assistant"]
        assert counted == "".join(f"{t}<|im_end|>\n" for t in turns), (i, counted)
        start = end + 1


def test_masked_targets_are_ignored_and_counted_over_the_global_batch(chat_data):
    data = PreparedData.open(chat_data[0])
    sampler = BatchSampler(data.n_tokens, 32, 8, seed=0)
    inputs, targets = sampler.rank_batch(data, 0, 0, 1)
    halves = [sampler.rank_batch(data, 0, r, 2)[1] for r in range(2)]
    counted = sampler.counted_targets(data, 0)
    assert (
        counted == int((targets != IGNORE_INDEX).sum()) == sum(int((h != IGNORE_INDEX).sum()) for h in halves)
    )
    assert 0 < counted < targets.numel() and inputs.min() >= 0


CASES = {
    # name: (world, layout); the single device takes the whole batch at once
    "dp2_accumulating": (2, ["--parallel.dp_shard=2", "--parallel.zero=1", "--training.micro_batch=1"]),
    "cp2": (2, ["--parallel.cp=2", "--parallel.dp_shard=1", "--training.micro_batch=4"]),
    "pp2": (2, ["--parallel.pp=2", "--training.micro_batch=2"]),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.micro_batch=8"]),
}


@pytest.fixture(scope="module")
def single_device(workers, chat_data) -> dict:
    return workers(1).run(run_layout, [*TINY, f"--data.path={chat_data[0]}", "--training.micro_batch=8"])[0]


@pytest.mark.parametrize("case", list(CASES))
def test_masked_loss_matches_one_device_in_every_layout(workers, chat_data, single_device, case):
    world, layout = CASES[case]
    results = workers(world).run(run_layout, [*TINY, f"--data.path={chat_data[0]}", *layout])
    for result in results:
        assert_losses_match(result["rows"], single_device["rows"])


def test_first_loss_equals_transformers_with_labels_minus_100(workers, chat_data, tmp_path):
    """A Hugging Face model fine-tuned on chat data: meshtron's first loss is transformers' own loss on
    the same global batch with labels -100 where the mask says the target does not count."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    tiny_run = [o for o in TINY if not o.startswith("--model.")]  # the checkpoint is the model
    overrides = [*tiny_run, f"--model.init_from={tmp_path / 'hf'}",
                 f"--data.path={chat_data[0]}", "--training.micro_batch=8", "--training.steps=1"]  # fmt: skip
    ours = workers(2).run(run_layout, [*overrides, "--parallel.dp_shard=2", "--training.micro_batch=4"], 1)
    data = PreparedData.open(chat_data[0])
    sampler = BatchSampler(data.n_tokens, 32, 8, seed=0)
    idx = sampler.global_indices(0)[:, None] * 33 + np.arange(33)[None, :]
    ids = torch.from_numpy(np.asarray(data.tokens[idx], dtype=np.int64))
    labels = ids.masked_fill(torch.from_numpy(np.asarray(data.loss_mask[idx]) == 0), IGNORE_INDEX)
    with torch.no_grad():
        theirs = float(hf(input_ids=ids, labels=labels).loss)
    assert abs(ours[0]["rows"][0]["loss"] - theirs) <= 1e-5 * abs(theirs), (
        ours[0]["rows"][0]["loss"],
        theirs,
    )


def test_chat_input_errors_say_what_to_fix(tmp_path, chat_data):
    tokenizer = chat_data[1]
    (tmp_path / "bad.jsonl").write_text('{"text": "no messages here"}\n')
    with pytest.raises(DataError, match='"messages"'):
        prepare_data([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer=str(tokenizer), chat=True)
    with pytest.raises(DataError, match="--tokenizer PATH"):
        prepare_data([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer="byte", chat=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes(Path(tokenizer).read_bytes())
    (tmp_path / "ok.jsonl").write_text(json.dumps(conversation(0)) + "\n")
    for config in (None, "{}"):  # no tokenizer_config.json, or one without a template: say where one goes
        if config is not None:
            (plain / "tokenizer_config.json").write_text(config)
        with pytest.raises(DataError, match=f"no chat template.*write .* to {plain / 'chat_template.jinja'}"):
            prepare_data(
                [tmp_path / "ok.jsonl"], tmp_path / "out", tokenizer=str(plain / "tokenizer.json"), chat=True
            )


def test_every_form_transformers_saves_a_template_in_renders_the_same(tmp_path, chat_data):
    """Issue 45.3: the template in chat_template.jinja (transformers 5's save_pretrained), in a
    chat_template.json, or in tokenizer_config.json (older transformers) prepares the same tokens and
    mask; the .jinja file wins over the others, as in transformers; the dataset keeps the files."""
    transformers = pytest.importorskip("transformers")
    from meshtron.data.tokenizer_files import chat_template, companion_files

    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(conversation(i)) for i in range(8)) + "\n")
    legacy = Path(chat_data[1]).parent
    saved = tmp_path / "saved"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(chat_data[1]), eos_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(saved)
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    processor = tmp_path / "processor"
    processor.mkdir()
    (processor / "tokenizer.json").write_bytes(Path(chat_data[1]).read_bytes())
    (processor / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    prepared = {}
    for folder in (legacy, saved, processor):
        out = prepare_data([tmp_path / "chats.jsonl"], tmp_path / f"out-{folder.name}",
                           tokenizer=str(folder / "tokenizer.json"), chat=True)  # fmt: skip
        prepared[folder.name] = (np.asarray(out.tokens).tolist(), np.asarray(out.loss_mask).tolist())
        assert companion_files(out.path) == companion_files(folder)  # carried on to checkpoints, exports
    assert prepared[saved.name] == prepared[legacy.name] == prepared[processor.name]
    assert sum(prepared[saved.name][1]) > 0
    both = {"chat_template.jinja": "jinja", "chat_template.json": '{"chat_template": "json"}'}
    assert chat_template({**both, "tokenizer_config.json": '{"chat_template": "config"}'}) == "jinja"
    assert (
        chat_template({"chat_template.json": both["chat_template.json"], "tokenizer_config.json": "{}"})
        == "json"
    )


def test_validation_loss_counts_the_same_targets_in_every_layout(workers, chat_data):
    """Validation (a held-out tail of the chat data) divides by its own counted targets: one device and
    dp 2 × pp 2 agree."""
    val = [*TINY, f"--data.path={chat_data[0]}", "--data.val_fraction=0.2", "--training.eval_batches=2"]
    one = workers(1).run(val_losses, [*val, "--training.micro_batch=8"])[0]
    four = workers(4).run(
        val_losses, [*val, "--parallel.dp_shard=2", "--parallel.pp=2", "--training.micro_batch=2"]
    )
    for (train_loss, val_loss), (want_train, want_val) in zip(four[0], one, strict=True):
        assert (
            abs(val_loss - want_val) <= 1e-5 * want_val and abs(train_loss - want_train) <= 1e-5 * want_train
        )


def test_validation_data_must_be_masked_like_the_training_data(chat_data, tmp_path):
    from meshtron.data.validation import split_validation
    from meshtron.rules.checks import load_config

    (tmp_path / "plain.txt").write_text("What is a mesh? " * 200)
    prepare_data([tmp_path / "plain.txt"], tmp_path / "plain", tokenizer=str(chat_data[1]))
    cfg = load_config(None, [*TINY, f"--data.val_path={tmp_path / 'plain'}"])
    with pytest.raises(DataError, match="has no loss mask.*both with --chat"):
        split_validation(cfg, PreparedData.open(chat_data[0]))
