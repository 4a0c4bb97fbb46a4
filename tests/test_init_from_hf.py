"""model.init_from: a run starts from a Hugging Face checkpoint in any layout, and its first loss is the
one transformers computes on the same batch; the config takes the checkpoint's architecture and refuses
keys that contradict it; a resumed run never re-reads the Hugging Face weights."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from meshtron import hf
from meshtron.config.huggingface import checkpoint_config
from meshtron.config.schema import ConfigError
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, prepare_data
from meshtron.data.sampler import BatchSampler
from meshtron.hf.checkpoint import HFCheckpoint, parameter_sources
from meshtron.models.llama import build_model
from meshtron.rules.checks import load_config, validate
from meshtron.testing.parity import relative, trainer_for
from meshtron.testing.tiny import ONE_STEP, ONE_STEP_BATCH, ONE_STEP_SEQ, perturb
from meshtron.train.setup import check_data
from meshtron.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 263  # above the byte tokenizer's 257, and odd: tensor parallel pads it
SEQ, BATCH = ONE_STEP_SEQ, ONE_STEP_BATCH
TRAINING = ONE_STEP
DENSE = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB
)


def hf_model(kind: str) -> torch.nn.Module:
    """A tiny transformers model with weights on the scale of a trained one."""
    config = {
        "llama": lambda: transformers.LlamaConfig(**DENSE, num_hidden_layers=4),
        "llama_tied": lambda: transformers.LlamaConfig(
            **DENSE, num_hidden_layers=4, tie_word_embeddings=True
        ),
        "mixtral": lambda: transformers.MixtralConfig(
            **dict(DENSE, intermediate_size=48),
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    }[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    perturb(model, seed=1)
    return model


@torch.no_grad()
def transformers_loss(model: torch.nn.Module, data: Path) -> float:
    """The mean cross-entropy transformers computes on the trainer's first global batch."""
    dataset = PreparedData.open(data)
    sampler = BatchSampler(dataset.n_tokens, SEQ, BATCH, seed=0)
    inputs, targets = sampler.rank_batch(dataset, 0, 0, 1)
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoint directories as transformers writes them (llama sharded, with an index; mixtral with
    transformers 5's fused experts) and the loss transformers computes for each on the first batch."""
    root = tmp_path_factory.mktemp("init_from")
    text = root / "text.txt"
    words = [f"w{(i * 7919) % 1009}" for i in range(6000)]
    text.write_text(" ".join(words))
    data = root / "data"
    prepare_data([text], data, tokenizer="byte")
    out: dict[str, Any] = {"data": data, "loss": {}, "elements": {}}
    for kind in ("llama", "llama_tied", "mixtral", "mixtral_fused"):
        model = hf_model(kind.removesuffix("_fused"))
        path = root / kind
        if kind == "mixtral_fused":  # the in-memory names: experts.gate_up_proj [E, 2F, D], down_proj
            model.config.save_pretrained(path)
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
            )
        else:
            model.save_pretrained(path, max_shard_size="60KB" if kind == "llama" else "1GB")
        out[kind] = path
        out["loss"][kind] = transformers_loss(model, data)
        with HFCheckpoint(path) as checkpoint:
            out["elements"][kind] = sum(math.prod(checkpoint.shape(n)) for n in checkpoint.names())
    assert (out["llama"] / "model.safetensors.index.json").is_file()
    return out


def run_overrides(checkpoints: dict[str, Any], kind: str, run_dir: Path, layout: list[str]) -> list[str]:
    return [
        f"--model.init_from={checkpoints[kind]}",
        f"--data.path={checkpoints['data']}",
        *TRAINING,
        f"--run.dir={run_dir}",
        *layout,
    ]


def first_step(overrides: list[str]) -> dict[str, Any]:
    """On every rank: the first step's loss and how many checkpoint values this rank read."""
    trainer = trainer_for(overrides)
    try:
        return {"loss": trainer.step(0)["loss"], "elements": trainer.job.init_report.elements}
    finally:
        trainer.close()


def trained(overrides: list[str]) -> tuple[Trainer, list[dict[str, Any]]]:
    """(the trainer, its metric rows) of a whole run on one device."""
    trainer = Trainer(load_config(None, overrides))
    try:
        return trainer, trainer.run()
    finally:
        trainer.close()


@pytest.mark.parametrize("kind", ("llama", "llama_tied", "mixtral_fused"))
def test_single_device_first_loss_is_transformers(
    checkpoints: dict[str, Any], kind: str, tmp_path: Path
) -> None:
    result = first_step(run_overrides(checkpoints, kind, tmp_path, []))
    assert relative(result["loss"], checkpoints["loss"][kind]) <= 1e-5, (result, checkpoints["loss"][kind])
    assert result["elements"] == checkpoints["elements"][kind]  # one device holds (and reads) it all


# (checkpoint, world size, layout): every parallelism, each rank reading only what it holds.
LAYOUTS = {
    "tp2": ("llama", 2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "pp2_tied": ("llama_tied", 2, ["--parallel.pp=2"]),
    "zero3_dp2": ("llama", 2, ["--parallel.dp_shard=2", "--parallel.zero=3"]),
    "cp2": ("llama", 2, ["--parallel.cp=2"]),  # FSDP over dp_shard x cp
    "fully_shard_dp2": ("llama_tied", 2, ["--parallel.dp_shard=2", "--parallel.fsdp_impl=torch"]),
    "fully_shard_dp2_x_tp2": (
        "llama_tied",
        4,
        ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.sp=true", "--parallel.fsdp_impl=torch"],
    ),
    "ep2": ("mixtral", 2, ["--parallel.dp_shard=2", "--parallel.ep=2"]),
    "tp2_ep2_zero1_fused": ("mixtral_fused", 4, ["--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
    "tp2_ep2_etp1": ("mixtral", 4, ["--parallel.tp=2", "--parallel.ep=2", "--parallel.etp=1"]),
    "pp2_tp2_tied": ("llama_tied", 4, ["--parallel.pp=2", "--parallel.tp=2"]),
    # ep 2 folded over tp 2 x dp_shard 4: 2 local experts over 4 edp ranks, each rank reading half of one
    # expert's matrices (config/row_blocks.py)
    "tp2_ep2_etp1_edp4_experts_cut_within": (
        "mixtral",
        8,
        ["--parallel.tp=2", "--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.etp=1"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_loss_is_transformers_in_every_layout(
    workers: Any, checkpoints: dict[str, Any], layout: str, tmp_path: Path
) -> None:
    kind, world, options = LAYOUTS[layout]
    results = workers(world).run(first_step, run_overrides(checkpoints, kind, tmp_path, options))
    want = checkpoints["loss"][kind]
    for result in results:
        assert relative(result["loss"], want) <= 1e-5, (layout, result["loss"], want)
    total = checkpoints["elements"][kind]
    assert all(0 < r["elements"] < total for r in results), (total, results)
    if layout == "zero3_dp2":  # disjoint row blocks: together exactly the checkpoint, each value once
        assert sum(r["elements"] for r in results) == total


def test_config_comes_from_the_checkpoint(checkpoints: dict[str, Any]) -> None:
    path = checkpoints["llama_tied"]
    cfg = load_config(None, [f"--model.init_from={path}"]).model
    assert (cfg.dim, cfg.n_layers, cfg.kv_heads, cfg.ffn_dim, cfg.vocab_size) == (64, 4, 2, 96, VOCAB)
    assert cfg.tie_embeddings and cfg.init_from == str(path)
    # Keys that repeat the checkpoint (0 deriving the same size counts), and training options, are fine.
    same = load_config(
        None,
        [f"--model.init_from={path}", "--model.dim=64", "--model.head_dim=0", "--model.z_loss_coef=0.001"],
    ).model
    assert same.head_dim == 16 and same.z_loss_coef == 0.001
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--model.init_from={path}", "--model.dim=128", "--model.tie_embeddings=false"])
    config_json = str(path / "config.json")
    assert f"model.dim=128 conflicts with {config_json}, which gives dim=64" in str(err.value)
    assert "model.tie_embeddings=False conflicts" in str(err.value) and "tie_embeddings=True" in str(
        err.value
    )
    with pytest.raises(
        ConfigError, match=r"model.name='tiny' and model.init_from disagree.*n_layers 2 \(preset\) vs 4"
    ):
        load_config(None, [f"--model.init_from={path}", "--model.name=tiny"])
    with pytest.raises(ConfigError, match=r"model.init_from='/nonexistent' is not a checkpoint.*config.json"):
        load_config(None, ["--model.init_from=/nonexistent"])


def test_a_preset_of_the_same_architecture_is_a_label(tmp_path: Path) -> None:
    tiny = load_config(None, ["--model.name=tiny"]).model
    hf.save(build_model(tiny), tmp_path)
    cfg = load_config(None, ["--model.name=tiny", f"--model.init_from={tmp_path}"]).model
    assert cfg.name == "tiny" and (cfg.dim, cfg.n_layers, cfg.ffn_dim) == (
        tiny.dim,
        tiny.n_layers,
        tiny.ffn_dim,
    )


def test_a_preset_with_keys_beside_it_is_compared_as_they_leave_it(tmp_path: Path) -> None:
    """A run's own file (`name = "tiny"` with `vocab_size = 300`) fine-tuning its exported checkpoint was
    refused: the preset's vocab_size was compared, not the file's. The keys beside the name replace the
    preset's, each checked against the checkpoint; a preset that still disagrees is refused."""
    import dataclasses

    tiny = dataclasses.replace(load_config(None, ["--model.name=tiny"]).model, vocab_size=300)
    hf.save(build_model(tiny), tmp_path / "hf")
    own = tmp_path / "own.toml"
    own.write_text('[model]\nname = "tiny"\nvocab_size = 300\n')
    assert load_config(own, [f"--model.init_from={tmp_path / 'hf'}"]).model.vocab_size == 300
    with pytest.raises(ConfigError, match=r"vocab_size 512 \(preset\) vs 300"):
        load_config(None, ["--model.name=tiny", f"--model.init_from={tmp_path / 'hf'}"])


def test_finetune_example_config_validates(checkpoints: dict[str, Any]) -> None:
    example = Path(__file__).resolve().parents[1] / "configs" / "finetune-example.toml"
    cfg = load_config(example, [f"--model.init_from={checkpoints['llama']}"])
    assert cfg.model.dim == 64 and cfg.checkpoint.resume and validate(cfg, 2) == []


def test_data_of_another_vocabulary_is_told_to_take_the_checkpoints_tokenizer(
    checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """model.init_from fixes model.vocab_size, so the advice is about the data (set the model's
    vocab_size would be refused, as a key contradicting config.json); a fp8 size likewise."""
    text = checkpoints["data"].parent / "text.txt"
    prepare_data([text], tmp_path / "wide", tokenizer="bpe", vocab_size=VOCAB + 40)
    path = tmp_path / "hf"
    shutil.copytree(checkpoints["llama"], path)
    run = [f"--model.init_from={path}", f"--data.path={tmp_path / 'wide'}"]
    with pytest.raises(DataError) as err:
        check_data(load_config(None, run))
    assert (
        f"--tokenizer TOKENIZER.json (the checkpoint's own tokenizer; {path} has no tokenizer.json)"
        in str(err.value)
    )
    prepare_data([text], tmp_path / "own", tokenizer="bpe", vocab_size=VOCAB)  # the checkpoint's tokenizer
    shutil.copy(tmp_path / "own" / "tokenizer.json", path / "tokenizer.json")
    with pytest.raises(DataError) as err:
        check_data(load_config(None, run))
    message = str(err.value)
    assert "vocab_size=" not in message.split(";", 1)[1]  # nothing said of the model's size
    command = message.split("meshtron prepare-data ", 1)[1]
    assert command.startswith(
        f"YOUR_TEXTS --out DIR --tokenizer {path / 'tokenizer.json'}, and set data.path=DIR"
    )
    # The advice followed: the data tokenized with the checkpoint's tokenizer.
    prepare_data([text], tmp_path / "retokenized", tokenizer=str(path / "tokenizer.json"))
    check_data(load_config(None, [run[0], f"--data.path={tmp_path / 'retokenized'}"]))
    fp8 = load_config(None, [run[0], "--training.dtype=fp8", "--parallel.tp=4"])  # ffn_dim 96 / 4 = 24
    assert any("model.init_from fixes those" in p for p in validate(fp8, 4, "cuda"))


def test_checkpoint_that_does_not_fit_is_named(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "broken"
    shutil.copytree(checkpoints["mixtral"], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(path / "model.safetensors"))
    cfg, model_type = checkpoint_config(path)
    with HFCheckpoint(path) as checkpoint, pytest.raises(ValueError) as err:
        parameter_sources(cfg, model_type, checkpoint)
    assert "missing tensors: model.layers.1.block_sparse_moe.experts.2.w3.weight" in str(err.value)
    assert "q_proj.weight: checkpoint [3, 64], expected [64, 64]" in str(err.value)


def test_resume_takes_precedence_over_init_from(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """A resumed run continues its own weights: the Hugging Face ones, changed in between, are not read."""
    path = tmp_path / "hf"
    shutil.copytree(checkpoints["llama_tied"], path)
    base = [
        f"--model.init_from={path}",
        f"--data.path={checkpoints['data']}",
        *TRAINING,
        "--training.steps=2",
    ]
    _, straight = trained([*base, f"--run.dir={tmp_path / 'straight'}"])
    run_dir = f"--run.dir={tmp_path / 'resumed'}"
    # checkpoint.resume=true with no checkpoint yet (configs/finetune-example.toml's way): from init_from.
    started, first = trained(
        [*base, run_dir, "--training.steps=1", "--checkpoint.every=1", "--checkpoint.resume=true"]
    )
    assert started.job.resumed_from is None and started.job.init_report is not None
    changed = hf_model("llama_tied")
    perturb(changed, seed=7)
    changed.save_pretrained(path)
    resumed, second = trained([*base, run_dir, "--checkpoint.resume=true", "--checkpoint.every=1"])
    assert resumed.job.resumed_from is not None and resumed.job.init_report is None
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    # The changed weights would have shown: a fresh run from them starts elsewhere.
    _, fresh = trained([*base, f"--run.dir={tmp_path / 'fresh'}", "--training.steps=1"])
    assert relative(fresh[0]["loss"], straight[0]["loss"]) > 1e-3
