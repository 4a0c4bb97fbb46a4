"""Export and decoding: a checkpoint of any layout becomes a Hugging Face directory whose logits are
meshtron's; KV-cached decoding computes what the whole sequence does; greedy decoding picks the tokens
transformers' greedy `generate` picks; a finished run prints a sample."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from meshtron import hf
from meshtron.checkpoint import CheckpointError
from meshtron.commands import main as cli
from meshtron.commands.export import checkpoint_config, export, load_checkpoint_model, resolve_checkpoint
from meshtron.config.schema import ModelConfig
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.models.generate import complete, dropless, generate
from meshtron.models.llama import KVCache, Transformer, build_model
from meshtron.models.moe import MoE
from meshtron.rules.checks import load_config
from meshtron.testing.parity import train_rows
from meshtron.testing.tiny import TINY, perturb
from meshtron.train.trainer import train

transformers = pytest.importorskip("transformers")

SAVING = ["--training.steps=3", "--checkpoint.every=3", "--run.sample_tokens=8"]
TP2_PP2_ZERO = [
    "--parallel.tp=2",
    "--parallel.pp=2",
    "--parallel.dp_shard=2",
    "--parallel.zero=3",
    "--training.micro_batch=2",
]
MIXTRAL = ["--model.name=tiny-moe", "--model.n_shared_experts=0"]  # no shared expert: Mixtral's shape
EP2 = ["--parallel.dp_shard=2", "--parallel.ep=2", "--training.micro_batch=4"]
PROMPT = "def main():\n    return"


def odd_model(**changes: object) -> Transformer:
    """A small model with weights on a trained model's scale (varied greedy tokens, real routing)."""
    base = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80, vocab_size=97)
    model = build_model(ModelConfig(**{**base, **changes}), seed=1).eval()
    perturb(model, seed=1)
    return model


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(sliding_window=5, qk_norm=True, qkv_bias=True),  # the window shorter than the sequence
        dict(rope_scaling="llama3", rope_original_max_position=16),
        dict(n_experts=4, top_k=2, moe_ffn_dim=48, capacity_factor=1.0, n_shared_experts=1),
    ],
    ids=["gqa", "window_qknorm_bias", "llama3_rope", "moe_capacity"],
)
def test_cached_decoding_equals_the_whole_sequence(changes):
    """A prompt, then single tokens, then a chunk, through the cache: the logits of the whole sequence
    at once (an MoE with a capacity decodes dropless both ways, and is left as it was)."""
    model = odd_model(**changes)
    tokens = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg, 2, 14)
    chunks = [(0, 6), *((i, i + 1) for i in range(6, 11)), (11, 14)]
    with torch.no_grad(), dropless(model):
        whole = model(tokens)
        cached = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in chunks], dim=1)
    assert cache.length == 14
    assert (cached - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert all(m.capacity_factor == 1.0 for m in model.modules() if isinstance(m, MoE))


def test_sampling_is_seeded_top_p_narrows_and_eos_stops():
    model = odd_model()
    prompt = [3, 14, 15, 92, 6]
    greedy = generate(model, prompt, 12)
    assert greedy.shape == (1, 12)
    draw = generate(model, prompt, 12, temperature=1.0, top_p=0.9, seed=7)
    assert torch.equal(draw, generate(model, prompt, 12, temperature=1.0, top_p=0.9, seed=7))
    assert not torch.equal(draw, greedy)  # at temperature 1 these weights spread their probability
    # A nucleus smaller than the likeliest token keeps that token alone: greedy again.
    assert torch.equal(generate(model, prompt, 12, temperature=1.0, top_p=1e-6, seed=7), greedy)
    eos = int(greedy[0, 3])
    assert generate(model, prompt, 12, eos_id=eos)[0].tolist() == greedy[0, :4].tolist()
    assert model.training is False


@pytest.mark.parametrize("changes", [dict(sliding_window=6), dict(n_experts=4, top_k=2, moe_ffn_dim=48)])
def test_greedy_decoding_matches_transformers(changes, tmp_path):
    """Mistral with a window shorter than the text, and Mixtral: the same 24 greedy tokens."""
    model = odd_model(**changes)
    hf.save(model, tmp_path)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([[5, 17, 2, 60, 33, 8]])
    ours = generate(model, prompt, 24)
    theirs = theirs_model.generate(prompt, max_new_tokens=24, do_sample=False)[:, prompt.shape[1] :]
    assert ours.tolist() == theirs.tolist()


def assert_export_matches(run_dir: Path, out: Path, single: Transformer | None = None) -> Transformer:
    """Export `run_dir`'s newest checkpoint; transformers' logits equal meshtron's for it, and so do
    its greedy tokens; with `single`, the checkpoint's weights are those a one-device run trained."""
    print(export(run_dir / "checkpoints", out))
    step_dir = resolve_checkpoint(run_dir / "checkpoints")
    ours = load_checkpoint_model(step_dir, checkpoint_config(step_dir))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == ByteTokenizer().encode(PROMPT) and tok.eos_token_id == 256
    with torch.no_grad():
        logits = ours(ids)
        assert (theirs(ids).logits - logits).abs().max() <= 1e-5 * logits.abs().max()
    greedy = theirs.generate(ids, max_new_tokens=16, do_sample=False)[:, ids.shape[1] :]
    assert generate(ours, ids, 16, eos_id=256).tolist() == greedy.tolist()
    if single is not None:
        for name, want in single.state_dict().items():
            got = ours.state_dict()[name]
            assert (got - want).norm() <= 1e-3 * want.norm(), name  # a misplaced block is O(1) off
    return ours


def test_export_of_a_tp2_pp2_zero3_checkpoint(workers, tmp_path, capsys):
    """Written by tp 2 x pp 2 x ZeRO-3 over dp_shard 2 (8 ranks); read on one device; the same run on
    one device (which prints its sample) trained the same weights."""
    run = [*TINY, *SAVING, f"--run.dir={tmp_path / 'tp2pp2'}"]
    workers(8).run(train_rows, [*run, *TP2_PP2_ZERO])
    single_dir = tmp_path / "single"
    train(load_config(None, [*TINY, *SAVING, f"--run.dir={single_dir}"]))
    sample = r"meshtron: sample \(greedy, \d+ tokens after the data's first 16\): .+ -> .+"
    assert re.search(sample, capsys.readouterr().out)
    step_dir = single_dir / "checkpoints" / "step-00000003"
    single = load_checkpoint_model(step_dir, checkpoint_config(step_dir))
    assert_export_matches(tmp_path / "tp2pp2", tmp_path / "hf", single)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert {"config.toml", "tokenizer.json"} <= manifest.keys()  # carried, and covered by the hashes


def test_export_of_an_expert_parallel_mixtral_checkpoint(workers, tmp_path):
    run_dir = tmp_path / "moe"
    workers(2).run(train_rows, [*TINY, *MIXTRAL, *EP2, *SAVING, f"--run.dir={run_dir}"])
    assert_export_matches(run_dir, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mixtral"


def test_export_of_an_expert_parallel_deepseek_checkpoint(workers, tmp_path):
    """DeepSeek-V3's shape: its router's correction bias is a buffer, learned by the bias step, not a
    parameter; `export` asked for parameters only and stopped with a KeyError (leaving a partial
    model.safetensors behind that refused the next try). The exported bias is the trained one, and the
    directory loads back and decodes as the checkpoint does."""
    run_dir = tmp_path / "deepseek"
    workers(2).run(train_rows, [*TINY, "--model.name=tiny-deepseek", *EP2, *SAVING, f"--run.dir={run_dir}"])
    ours = assert_export_matches(run_dir, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "deepseek_v3"
    bias = ours.state_dict()["layers.1.moe.router.expert_bias"]
    assert bias.abs().max() > 0  # trained: what transformers' logits matched was not zeros
    # `meshtron generate --hf` of any MoE model failed: hf.load left the load counters on the meta device.
    loaded = hf.load(tmp_path / "hf")
    assert not any(b.is_meta for b in loaded.buffers())
    ids = torch.tensor([[5, 17, 2, 60]])
    assert torch.equal(generate(loaded.to("cpu"), ids, 8), generate(ours, ids, 8))


def test_a_failed_export_leaves_no_weights_behind(tmp_path):
    """A tensor that cannot be read stops the export; the shards written before it are removed, so the
    next try is not refused as an export over existing weights."""
    from meshtron.hf.stream import Entry, save_streamed

    def read(source: str) -> torch.Tensor:
        if source == "b":
            raise KeyError(source)
        return torch.ones(4, 4)

    entries = [Entry(name, (4, 4), name) for name in ("a", "b")]
    with pytest.raises(KeyError):
        save_streamed(tmp_path, entries, torch.float32, read, max_shard_bytes=64)
    assert list(tmp_path.iterdir()) == []


def test_commands_and_checkpoint_forms(tmp_path, capsys):
    """`export` and `generate` take a step, checkpoints or run directory; the newest intact checkpoint
    is used (a corrupt one is skipped); what is not a checkpoint is refused with exit status 2."""
    run_dir = tmp_path / "run"
    train(load_config(None, [*TINY, *SAVING, "--run.sample_tokens=0", f"--run.dir={run_dir}"]))
    assert "meshtron: sample" not in capsys.readouterr().out
    step = run_dir / "checkpoints" / "step-00000003"
    newer = shutil.copytree(step, run_dir / "checkpoints" / "step-00000004")
    (newer / "__0_0.distcp").write_bytes(b"corrupt")
    assert resolve_checkpoint(run_dir) == resolve_checkpoint(run_dir / "checkpoints") == step
    assert "skipping corrupt checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="is corrupt"):
        resolve_checkpoint(newer)

    assert cli.main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 0
    assert "llama, 158,016 parameters (float32), max_position_embeddings 32" in capsys.readouterr().out
    seq_len = load_config(None, TINY).training.seq_len  # from scratch: the context it was trained for
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == seq_len
    bf16 = ["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]
    assert cli.main(bf16) == 0
    capsys.readouterr()
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    args = ["--prompt", PROMPT, "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu"]
    assert cli.main(["generate", "--checkpoint", str(run_dir), *args]) == 0
    from_checkpoint = capsys.readouterr().out
    assert cli.main(["generate", "--hf", str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out == from_checkpoint
    model = load_checkpoint_model(step, checkpoint_config(step))
    assert from_checkpoint == PROMPT + complete(model, ByteTokenizer(), PROMPT, 10) + "\n"

    assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_a_config_no_hf_architecture_computes_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    sigmoid = ["--model.name=tiny-moe", "--model.router=sigmoid"]
    train(load_config(None, [*TINY, *sigmoid, *SAVING, "--run.sample_tokens=0", f"--run.dir={run_dir}"]))
    with pytest.raises(CheckpointError, match="cannot export.*router='sigmoid'"):
        export(run_dir, tmp_path / "hf")


def test_a_trained_bpe_tokenizer_exports_for_auto_tokenizer(tmp_path):
    """The default corpus's tokenizer kind (a byte-level BPE meshtron trains) loads with AutoTokenizer
    after export and encodes and decodes as meshtron's does."""
    from transformers import AutoTokenizer

    from meshtron.commands.export import save_hf_tokenizer
    from meshtron.data.tokenizer import train_bpe

    text = tmp_path / "corpus.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 50 + "print(add(1, 2))  # three\n")
    tok = train_bpe([text], 300, tmp_path / "bpe.json")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')  # export writes the model's first
    save_hf_tokenizer(tok, out)
    hf = AutoTokenizer.from_pretrained(out)
    sample = "def add(x, y):\n    return x + y  # sum\n"
    assert hf.encode(sample, add_special_tokens=False) == tok.encode(sample)
    assert hf.decode(tok.encode(sample)) == sample
    assert hf.eos_token_id == tok.eos_id


def test_streamed_weights_are_sharded_as_transformers_writes_them(tmp_path):
    """Past the size limit the weights go to several safetensors files and an index, each tensor as the
    safetensors library reads it back; transformers loads the directory with meshtron's logits."""
    from safetensors import safe_open

    from meshtron.hf.stream import INDEX_FILE
    from meshtron.hf.weights import hf_state_dict, save_model

    model = odd_model(n_experts=4, top_k=2, moe_ffn_dim=48)
    save_model(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    _, want = hf_state_dict(model)
    assert set(index["weight_map"]) == set(want)
    for file in files:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                assert index["weight_map"][key] == file and torch.equal(f.get_tensor(key), want[key]), key
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[5, 17, 2, 60, 33, 8]])
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(FileExistsError, match="export to a new directory"):
        save_model(model, tmp_path)


def test_export_holds_one_parameter_at_a_time(tmp_path, monkeypatch):
    """`meshtron export` streams: each parameter is read from the checkpoint when its tensors are written
    and let go before the next one is read (so its peak is about the largest parameter, not the model)."""
    import weakref

    from meshtron.commands import export as export_module

    run_dir = tmp_path / "run"
    train(load_config(None, [*TINY, *MIXTRAL, *SAVING, "--run.sample_tokens=0", f"--run.dir={run_dir}"]))
    alive: list[weakref.ref] = []
    most = [0]
    real = export_module.read_model_tensor

    def tracked(path: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        tensor = real(path, name, shape)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(export_module, "read_model_tensor", tracked)
    export(run_dir, tmp_path / "hf", max_shard_bytes=100_000)
    assert len(alive) == sum(1 for _ in load_checkpoint_model(resolve_checkpoint(run_dir), checkpoint_config(
        resolve_checkpoint(run_dir))).parameters())  # fmt: skip
    assert most[0] == 0  # none of the earlier ones was alive when the next was read
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.model_type == "mixtral"
