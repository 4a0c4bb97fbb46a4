"""Hugging Face interop: meshtron logits match transformers' on every supported architecture, both ways."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron import hf
from meshtron.config.schema import ModelConfig
from meshtron.models.llama import build_model
from meshtron.testing.tiny import perturb

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
BATCH, SEQ = 2, 12


def hf_case(name: str) -> tuple[str, dict[str, Any]]:
    """(transformers config class, its kwargs) for a tiny, deliberately odd-sized model."""
    # With head_dim 16 this puts frequencies in all three llama3 bands (kept, smoothed, scaled).
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
    small = dict(hidden_size=40, num_attention_heads=5, vocab_size=97, num_hidden_layers=2)
    wide = dict(hidden_size=48, num_attention_heads=6)
    # fmt: off
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "llama": ("LlamaConfig", dict(**wide, num_key_value_heads=2, intermediate_size=100, vocab_size=101,
                  num_hidden_layers=3, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
        "llama3_rope": ("LlamaConfig", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                        intermediate_size=72, vocab_size=101, num_hidden_layers=2, rope_parameters=llama3_rope)),
        "llama_tied": ("LlamaConfig", dict(**small, num_key_value_heads=1, intermediate_size=68, tie_word_embeddings=True)),
        # a window shorter than SEQ, so that it changes the result
        "mistral": ("MistralConfig", dict(**wide, num_key_value_heads=3, intermediate_size=84, vocab_size=101,
                    num_hidden_layers=2, sliding_window=5)),
        # Qwen2 windows the layers from max_window_layers on: here all of them.
        "qwen2": ("Qwen2Config", dict(**small, num_key_value_heads=5, intermediate_size=76, use_sliding_window=True,
                  sliding_window=6, max_window_layers=0)),
        # head_dim not hidden/heads: the mapping must carry it
        "qwen3": ("Qwen3Config", dict(**wide, num_key_value_heads=2, head_dim=12, intermediate_size=92, vocab_size=97,
                  num_hidden_layers=2)),
        "mixtral": ("MixtralConfig", dict(**small, num_key_value_heads=1, intermediate_size=56, num_local_experts=4,
                    num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(**small | dict(num_hidden_layers=4), num_key_value_heads=1,
                      intermediate_size=60, moe_intermediate_size=20, shared_expert_intermediate_size=36, num_experts=5,
                      num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2])),
        "qwen2_moe_sparse_step": ("Qwen2MoeConfig", dict(**small, num_key_value_heads=5, intermediate_size=60,
                                  moe_intermediate_size=28, shared_expert_intermediate_size=44, num_experts=3,
                                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(**wide, num_key_value_heads=3, head_dim=10, vocab_size=101,
                      num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True)),
    }
    # fmt: on
    return cases[name]


def tokens(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    config_cls, kwargs = hf_case(name)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    perturb(model, seed)
    return model


@torch.no_grad()
def max_diff(meshtron_model: torch.nn.Module, hf_model: torch.nn.Module, vocab_size: int) -> float:
    ids = tokens(vocab_size)
    ours = meshtron_model(ids)
    theirs = hf_model(input_ids=ids).logits
    assert ours.shape == theirs.shape
    assert theirs.abs().max() > 0.5  # logits large enough that a 1e-4 agreement means something
    return (ours - theirs).abs().max().item()


def load_from_hf(name: str, tmp_path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    return hf.load(tmp_path), hf_model


@pytest.mark.parametrize(
    "name",
    (
        "llama",
        "llama3_rope",
        "llama_tied",
        "mistral",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen2_moe",
        "qwen2_moe_sparse_step",
        "qwen3_moe",
    ),
)
def test_load_matches_transformers(name: str, tmp_path: Path) -> None:
    model, hf_model = load_from_hf(name, tmp_path)
    diff = max_diff(model, hf_model, hf_model.config.vocab_size)
    assert diff <= TOLERANCE, f"{name}: max abs logit diff {diff:.3g}"


def test_loaded_configs_carry_the_architecture(tmp_path: Path) -> None:
    cfg = load_from_hf("qwen2_moe", tmp_path / "a")[0].cfg
    assert (cfg.n_experts, cfg.top_k, cfg.moe_ffn_dim, cfg.shared_ffn_dim) == (5, 2, 20, 36)
    assert cfg.shared_expert_gate and cfg.qkv_bias and not cfg.router_norm_topk
    assert cfg.dense_layers == [2] and [cfg.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    assert load_from_hf("mistral", tmp_path / "b")[0].cfg.sliding_window == 5
    qwen3 = load_from_hf("qwen3", tmp_path / "c")[0].cfg
    assert qwen3.qk_norm and qwen3.head_size == 12 and qwen3.kv_heads == 2
    assert load_from_hf("llama_tied", tmp_path / "d")[0].output is None
    assert load_from_hf("qwen2", tmp_path / "e")[0].cfg.sliding_window == 6


def test_load_dtype(tmp_path: Path) -> None:
    make_hf_model("qwen3").save_pretrained(tmp_path)
    model = hf.load(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.requires_grad for p in model.parameters())
    assert model(tokens(97)).dtype == torch.bfloat16


def test_wrong_mapping_would_be_caught(tmp_path: Path) -> None:
    """The comparison has teeth: swapping gate and up projections in one layer breaks it."""
    model, hf_model = load_from_hf("llama", tmp_path)
    ffn = model.layers["1"].feed_forward
    with torch.no_grad():
        w1 = ffn.w1.weight.clone()
        ffn.w1.weight.copy_(ffn.w3.weight)
        ffn.w3.weight.copy_(w1)
    assert max_diff(model, hf_model, hf_model.config.vocab_size) > 1e-2


def test_old_style_rope_config(tmp_path: Path) -> None:
    """A transformers-4 config.json (top-level rope_theta, rope_scaling) loads to the same model."""
    hf_model = make_hf_model("llama3_rope")
    hf_model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    config_file.write_text(json.dumps(config))
    model = hf.load(tmp_path)
    assert model.cfg.rope_scaling == "llama3" and model.cfg.rope_original_max_position == 256
    assert max_diff(model, hf_model, 101) <= TOLERANCE


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2_moe")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert max_diff(hf.load(tmp_path), hf_model, 97) <= TOLERANCE


@pytest.mark.parametrize("name", ("mixtral", "qwen3_moe"))
def test_fused_expert_layout(name: str, tmp_path: Path) -> None:
    """transformers 5's in-memory names: experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F]."""
    hf_model = make_hf_model(name)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    hf_model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert max_diff(hf.load(tmp_path), hf_model, hf_model.config.vocab_size) <= TOLERANCE


def meshtron_case(name: str) -> ModelConfig:
    base = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=101, norm_eps=1e-5)
    moe = dict(n_experts=5, top_k=2, moe_ffn_dim=20)
    cases: dict[str, dict[str, Any]] = {
        "llama": dict(base, rope_scaling="llama3", rope_original_max_position=256, tie_embeddings=True),
        "mistral": dict(base, sliding_window=5),
        "qwen2": dict(base, n_kv_heads=3, qkv_bias=True),
        "qwen3": dict(base, qk_norm=True, head_dim=12, rope_theta=1e6),
        "mixtral": dict(base, **moe, n_kv_heads=1),
        "qwen2_moe": dict(
            base,
            **moe,
            n_layers=3,
            qkv_bias=True,
            n_shared_experts=1,
            shared_ffn_dim=36,
            shared_expert_gate=True,
            router_norm_topk=False,
            dense_layers=[1],
        ),
        "qwen3_moe": dict(base, **moe, qk_norm=True, head_dim=10, moe_every=2, n_layers=3, sliding_window=5),
    }
    return ModelConfig(**cases[name])


@pytest.mark.parametrize("name", ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"))
def test_save_loads_in_transformers(name: str, tmp_path: Path) -> None:
    cfg = meshtron_case(name)
    model = build_model(cfg, seed=1).eval()
    perturb(model, seed=1)
    hf.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == name

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert max_diff(model, hf_model.eval(), cfg.vocab_size) <= TOLERANCE

    # And back: the same configuration and the same tensors.
    again = hf.load(tmp_path)
    expected = dataclasses.replace(cfg, head_dim=cfg.head_size, n_kv_heads=cfg.kv_heads)
    if name == "mixtral":  # every Mixtral layer is MoE, so it has one ffn size: the experts'
        expected = dataclasses.replace(expected, ffn_dim=cfg.expert_ffn_dim)
    assert again.cfg == expected
    theirs = again.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in model.state_dict().items())


def test_unsupported_model_type() -> None:
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama, mistral, qwen2"):
        hf.config_from_hf({"model_type": "gpt2", "hidden_size": 8})


@pytest.mark.parametrize(
    "rope",
    (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
)
def test_unsupported_rope_type(rope: dict[str, Any]) -> None:
    config = dict(hf_case("llama")[1], model_type="llama")
    config.pop("rope_parameters")
    config.update(rope)
    kind = next(iter(rope.get("rope_parameters") or rope["rope_scaling"]))
    name = (rope.get("rope_parameters") or rope["rope_scaling"])[kind]
    with pytest.raises(ValueError, match=rf"rope type '{name}' is not supported.*default, llama3"):
        hf.config_from_hf(config)


def test_unsupported_config_features() -> None:
    base = dict(hf_case("qwen2")[1], model_type="qwen2")
    mixed = dict(base, use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None)
    with pytest.raises(ValueError, match=r"sliding window 4 on only some layers \(\[1\]\)"):
        hf.config_from_hf(mixed)
    llama = dict(hf_case("llama")[1], model_type="llama", attention_bias=True, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act='gelu'.*attention_bias=true"):
        hf.config_from_hf(llama)


def rewrite_weights(path: Path, edit: Any) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor(tmp_path: Path) -> None:
    make_hf_model("qwen2").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.bias"):
        hf.load(tmp_path)


def test_missing_expert(tmp_path: Path) -> None:
    make_hf_model("mixtral").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.3\.w2\.weight"):
        hf.load(tmp_path)


def test_wrong_shape(tmp_path: Path) -> None:
    make_hf_model("llama").save_pretrained(tmp_path)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(99, 48)

    rewrite_weights(tmp_path, edit)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight: checkpoint \[99, 48\], expected \[100, 48\]",
    ):
        hf.load(tmp_path)


def test_unexpected_tensor(tmp_path: Path) -> None:
    make_hf_model("llama").save_pretrained(tmp_path)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)

    rewrite_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        hf.load(tmp_path)


class WritesWhenUnpickled:
    """A pickle payload like a malicious checkpoint's: unpickling it runs code (here: writes a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.marker.write_text, ("unpickled",))


def test_pickle_only_checkpoint_is_refused_unread(tmp_path: Path) -> None:
    """A directory with pytorch_model.bin and no safetensors is refused with the reason, and the pickle is
    never opened: its payload would have run."""
    make_hf_model("llama").config.save_pretrained(tmp_path)
    marker = tmp_path / "ran.txt"
    blob = pickle.dumps({"model.embed_tokens.weight": WritesWhenUnpickled(marker)})
    pickle.loads(blob)  # the payload is live: unpickling runs it
    assert marker.read_text() == "unpickled"
    marker.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(blob)
    with pytest.raises(
        ValueError, match=r"only pickled PyTorch weights \(pytorch_model\.bin\).*refuses to unpickle"
    ):
        hf.load(tmp_path)
    assert not marker.exists()


def test_index_naming_other_than_safetensors_shards_is_refused(tmp_path: Path) -> None:
    make_hf_model("llama").config.save_pretrained(tmp_path)
    weight_map = {
        "a": "pytorch_model-00001-of-00002.bin",
        "b": "../elsewhere.safetensors",
        "c": "ok.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        ValueError,
        match=r"not \.safetensors files in .*: \.\./elsewhere\.safetensors, pytorch_model-00001-of-00002\.bin;",
    ):
        hf.load(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    (
        (dict(router="sigmoid"), "sigmoid"),
        (dict(router_bias_rate=0.001), "DeepSeek-V3's routing"),
        (dict(n_expert_groups=2, topk_expert_groups=1), "DeepSeek-V3's routing"),
        (dict(n_shared_experts=1), "shared experts without shared_expert_gate"),
        (dict(router_norm_topk=False), "Mixtral always renormalises"),
        (dict(qk_norm=True, qkv_bias=True), "qk_norm with qkv_bias"),
    ),
)
def test_save_refuses_inexpressible_configs(change: dict[str, Any], message: str, tmp_path: Path) -> None:
    cfg = dataclasses.replace(meshtron_case("mixtral"), **change)
    with pytest.raises(ValueError, match=message):
        hf.save(build_model(cfg), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
