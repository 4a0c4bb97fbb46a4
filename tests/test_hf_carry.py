"""Issue 45.8 and 45.3: an export keeps what the run was given. After `model.init_from` a transformers
checkpoint (a context of 256, bos/pad tokens, a chat template, a generation config), trained on one
layout and resumed on another, `meshtron export` writes a directory whose config.json carries every field
of the original's and whose tokenizer transformers loads with the original's special tokens and template;
a template in its legacy forms is written back as transformers 5 writes it; a run from scratch declares
the context it was trained for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtron.commands.export import checkpoint_config, export, load_checkpoint_model, resolve_checkpoint
from meshtron.config.huggingface import config_to_hf
from meshtron.config.schema import ModelConfig
from meshtron.data.dataset import prepare_data
from meshtron.data.tokenizer_files import CHAT_TEMPLATE_JINJA, CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG
from meshtron.hf.carry import CARRIED_FILE, exported_config, write_carried
from meshtron.rules.checks import load_config
from meshtron.testing.parity import train_rows
from meshtron.train.trainer import train

transformers = pytest.importorskip("transformers")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "The mesh has ranks. A pipeline has stages. Experts route tokens. " * 60


def saved_tokenizer(folder: Path, chat_template: str | None = TEMPLATE):
    """A byte-level BPE with bos, eos and pad, saved by transformers' own save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(TEXT.split(". "), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as transformers saves it: model, tokenizer (template in chat_template.jinja) and a
    generation config, with fields meshtron's ModelConfig does not hold."""
    folder = tmp_path_factory.mktemp("source")
    tok = saved_tokenizer(folder)
    assert (folder / CHAT_TEMPLATE_JINJA).is_file()  # transformers 5's form
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        num_hidden_layers=2, vocab_size=len(tok), max_position_embeddings=256, rope_theta=50000.0, **ids,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.GenerationConfig(**ids, max_new_tokens=7).save_pretrained(folder)
    return folder


def test_an_init_from_run_resumed_on_another_layout_exports_what_it_was_given(
    source: Path, tmp_path: Path, workers
) -> None:
    (tmp_path / "text.txt").write_text(TEXT)
    prepare_data([tmp_path / "text.txt"], tmp_path / "data", tokenizer=str(source / "tokenizer.json"))
    run = [
        f"--model.init_from={source}", f"--data.path={tmp_path / 'data'}", f"--run.dir={tmp_path / 'run'}",
        "--training.seq_len=32", "--training.global_batch=4", "--training.micro_batch=2",
        "--checkpoint.every=2", "--run.plot=false", "--run.sample_tokens=0",
    ]  # fmt: skip
    train(load_config(None, [*run, "--training.steps=2"]))  # one device
    zero3 = ["--parallel.dp_shard=2", "--parallel.zero=3", "--training.micro_batch=1"]
    workers(2).run(train_rows, [*run, *zero3, "--training.steps=4", "--checkpoint.resume=true"])
    step_dir = resolve_checkpoint(tmp_path / "run")
    assert step_dir.name == "step-00000004" and (step_dir / CARRIED_FILE).is_file()
    line = export(step_dir, tmp_path / "hf")
    assert "max_position_embeddings 256" in line and "chat_template.jinja" in line

    original, exported = (json.loads((d / "config.json").read_text()) for d in (source, tmp_path / "hf"))
    assert {k: exported.get(k) for k in original} == original  # every field, max_position_embeddings too
    for name in ("generation_config.json", CHAT_TEMPLATE_JINJA):
        assert (tmp_path / "hf" / name).read_text() == (source / name).read_text()
    theirs, ours = (transformers.AutoTokenizer.from_pretrained(d) for d in (source, tmp_path / "hf"))
    for attribute in ("bos_token", "eos_token", "pad_token", "bos_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert ours.chat_template == TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.max_position_embeddings == 256
    assert model.generation_config.max_new_tokens == 7
    ids = torch.tensor([ours.encode("The mesh has stages.")])
    with torch.no_grad():
        want = load_checkpoint_model(step_dir, checkpoint_config(step_dir))(ids)
        assert (model(ids).logits - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("form", ("tokenizer_config", "chat_template.json"))
def test_a_legacy_template_is_written_back_as_transformers_5_writes_it(form: str, tmp_path: Path) -> None:
    """Older transformers kept the template in tokenizer_config.json (or a processor's
    chat_template.json); the export writes chat_template.jinja, which AutoTokenizer reads."""
    tok = saved_tokenizer(tmp_path / "tok", chat_template=None)
    files = {TOKENIZER_CONFIG: (tmp_path / "tok" / TOKENIZER_CONFIG).read_text()}
    if form == "tokenizer_config":
        config = {**json.loads(files[TOKENIZER_CONFIG]), "chat_template": TEMPLATE}
        files[TOKENIZER_CONFIG] = json.dumps(config)
    else:
        files[CHAT_TEMPLATE_JSON] = json.dumps({"chat_template": TEMPLATE})
    out = tmp_path / "hf"
    out.mkdir()
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config_to_hf(ModelConfig(vocab_size=len(tok)))))
    write_carried(files, out, seq_len=64)
    assert not (out / CHAT_TEMPLATE_JSON).exists()
    assert "chat_template" not in json.loads((out / TOKENIZER_CONFIG).read_text())
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.chat_template == TEMPLATE and loaded.pad_token == "<pad>"


def test_a_run_from_scratch_declares_the_context_it_trained() -> None:
    """No init_from: max_position_embeddings is the trained seq_len; under llama3 RoPE scaling it is the
    scaling's own context (transformers wants it above the original)."""
    plain = config_to_hf(ModelConfig())
    assert exported_config(plain, None, seq_len=128)["max_position_embeddings"] == 128
    scaled = ModelConfig(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_position=512)
    assert exported_config(config_to_hf(scaled), None, seq_len=128)["max_position_embeddings"] == 8 * 512


def test_data_prepared_without_the_files_takes_init_froms_when_its_tokenizer_is_the_same(
    source: Path, tmp_path: Path
) -> None:
    """Data prepared before prepare-data copied the tokenizer's files: model.init_from's are carried
    when its tokenizer.json is the data's, byte for byte, and never for another tokenizer."""
    from meshtron.hf.carry import carried_files

    same, other = tmp_path / "same", tmp_path / "other"
    for folder in (same, other):
        folder.mkdir()
    (same / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    (other / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes() + b"\n")
    names = {"config.json", "generation_config.json", CHAT_TEMPLATE_JINJA, TOKENIZER_CONFIG}
    assert carried_files(str(source), same / "tokenizer.json").keys() == names
    assert carried_files(str(source), other / "tokenizer.json").keys() == {
        "config.json",
        "generation_config.json",
    }
    assert carried_files("", same / "tokenizer.json") == {}  # from scratch, a tokenizer with no files
