"""Hugging Face checkpoints <-> meshtron models: weight renaming and strict loading (configs: config/huggingface.py).

`load` reads a directory as `transformers` writes it (config.json + model.safetensors, or shards with
model.safetensors.index.json) for llama, mistral, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe, and
never pickled weights (pytorch_model.bin: unpickling can run code; such a directory is refused);
`save` writes one that `transformers.AutoModelForCausalLM.from_pretrained` loads with no missing or
unexpected keys. The mapping follows what transformers 5 computes, not only what its configs name:
e.g. Qwen2 always has q/k/v biases, Qwen3 defaults head_dim to 128, Mixtral always renormalises its
top-k routing weights.

Weight names (per layer i, HF side under `model.layers.{i}.`):
    tok_embeddings / norm / output          model.embed_tokens / model.norm / lm_head
    attention_norm / ffn_norm               input_layernorm / post_attention_layernorm
    attention.{wq,wk,wv,wo}                 self_attn.{q,k,v,o}_proj   (+ bias on q/k/v)
    attention.{q_norm,k_norm}               self_attn.{q_norm,k_norm}
    feed_forward.{w1,w3,w2}                 mlp.{gate,up,down}_proj
    moe.router                              mlp.gate  (Mixtral: block_sparse_moe.gate)
    moe.experts.{w1,w3,w2} [E, ...]         mlp.experts.{j}.{gate,up,down}_proj  (Mixtral:
                                            block_sparse_moe.experts.{j}.{w1,w3,w2}); fused
                                            experts.gate_up_proj [E, 2F, D] / experts.down_proj
                                            [E, D, F] is accepted on load
    moe.shared_experts.{w1,w3,w2}           mlp.shared_expert.{gate,up,down}_proj
    moe.shared_gate                         mlp.shared_expert_gate

What `save` refuses (no supported HF architecture computes it): a sigmoid router, DeepSeek-V3's routing
(scaled gates, expert groups, a balancing bias), shared experts
without a sigmoid gate, q/k norms together with q/k/v biases (Qwen3's `attention_bias` also biases
o_proj), shared experts with q/k norms, and a Mixtral-shaped MoE (no shared experts, no q/k norms)
that does not renormalise its top-k weights, has dense layers, or has q/k/v biases. What it writes
without a trace, because it changes training but not the function the weights compute:
`capacity_factor` (HF inference is dropless, which equals meshtron's capacity_factor=0) and
`z_loss_coef`; `aux_loss_coef` becomes `router_aux_loss_coef`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from meshtron.config.huggingface import config_from_hf, config_to_hf, read_hf_config, weight_files
from meshtron.config.schema import ModelConfig
from meshtron.hf.stream import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, Entry, save_streamed
from meshtron.models.llama import Transformer
from meshtron.models.moe import MoE
from meshtron.models.rope import rope_inv_freq

# meshtron key suffix inside a layer -> HF key suffix inside `model.layers.{i}.`; `{moe}` is the
# MoE block's module name.
LAYER_RENAMES = (
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("attention.wq.bias", "self_attn.q_proj.bias"),
    ("attention.wk.bias", "self_attn.k_proj.bias"),
    ("attention.wv.bias", "self_attn.v_proj.bias"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
    ("attention.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attention.q_latent_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("attention.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attention.kv_latent_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("attention.wkv_b.weight", "self_attn.kv_b_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("moe.router.weight", "{moe}.gate.weight"),
    ("moe.router.expert_bias", "{moe}.gate.e_score_correction_bias"),
    ("moe.shared_experts.w1.weight", "{moe}.{shared}.gate_proj.weight"),
    ("moe.shared_experts.w3.weight", "{moe}.{shared}.up_proj.weight"),
    ("moe.shared_experts.w2.weight", "{moe}.{shared}.down_proj.weight"),
    ("moe.shared_gate.weight", "{moe}.shared_expert_gate.weight"),
)
GLOBAL_RENAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
# Qwen2-MoE's one shared expert and DeepSeek's shared experts.
SHARED_EXPERTS = {"deepseek_v3": "shared_experts"}


def layer_renames(model_type: str, moe_block: str = "mlp") -> dict[str, str]:
    """LAYER_RENAMES for one model type, with its MoE block's name."""
    shared = SHARED_EXPERTS.get(model_type, "shared_expert")
    return {ours: theirs.format(moe=moe_block, shared=shared) for ours, theirs in LAYER_RENAMES}


# Per-expert projection names for our (w1 gate, w3 up, w2 down), in the two HF spellings.
QWEN_EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
MIXTRAL_EXPERT_NAMES = (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))
# Buffers older transformers wrote into checkpoints; they are recomputed, never loaded.
IGNORED_KEY_PATTERN = re.compile(r"\.rotary_emb\.inv_freq$")
# DeepSeek-V3 ships its multi-token prediction modules as layers num_hidden_layers + k: their own norms
# and projection, a decoder layer, and copies of the main embedding and head (which meshtron shares).
MTP_RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
LAYER_NUMBER = re.compile(r"^model\.layers\.(\d+)\.")


def block_location(name: str, n_layers: int) -> tuple[str, str] | None:
    """(the HF layer prefix, the name inside the block) of a block's parameter: layers.i.X is layer i, an
    MTP depth's mtp.k.block.X layer n_layers + k (where DeepSeek ships it); None for any other."""
    head, index, rest = (name.split(".", 2) + ["", ""])[:3]
    if head == "layers":
        return f"model.layers.{index}.", rest
    if head == "mtp" and rest.startswith("block."):
        return f"model.layers.{n_layers + int(index)}.", rest.removeprefix("block.")
    return None


def mtp_name(name: str, n_layers: int) -> str:
    """The HF name of an MTP depth's own parameter mtp.k.X (its norms and projection)."""
    _, index, rest = name.split(".", 2)
    return f"model.layers.{n_layers + int(index)}.{MTP_RENAMES[rest]}"


def mtp_layer(name: str, n_layers: int) -> int | None:
    """Which MTP module (0, 1, ...) an HF tensor belongs to (a layer past num_hidden_layers), or None."""
    match = LAYER_NUMBER.match(name)
    return int(match.group(1)) - n_layers if match and int(match.group(1)) >= n_layers else None


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded safetensors checkpoint (`weight_files`), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if key in tensors:
                    raise ValueError(f"tensor {key!r} appears in more than one shard (again in {file.name})")
                tensors[key] = f.get_tensor(key)
    return tensors


def _names(keys: Iterable[str], limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


class _Source:
    """Hands out checkpoint tensors by HF name, remembering which were used and what was missing."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.bad_shapes: list[str] = []

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if key not in self.tensors:
            self.missing.append(key)
            return None
        self.used.add(key)
        tensor = self.tensors[key]
        if tuple(tensor.shape) != tuple(shape):
            self.bad_shapes.append(f"{key}: checkpoint {list(tensor.shape)}, expected {list(shape)}")
            return None
        return tensor


def _load_experts(
    src: _Source, layer: str, cfg: ModelConfig, model_type: str
) -> dict[str, torch.Tensor | None]:
    """Our stacked experts.{w1,w3,w2} from per-expert 2-D tensors or the fused 3-D layout."""
    E, D, F = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
    # transformers 5 names Mixtral's block `mlp` internally; checkpoints use `block_sparse_moe`.
    blocks = ("block_sparse_moe", "mlp") if model_type == "mixtral" else ("mlp",)
    styles = [(block, names) for block in blocks for names in (MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES)]
    for block in blocks:
        fused = f"{layer}{block}.experts.gate_up_proj"
        if src.has(fused):
            gate_up = src.take(fused, (E, 2 * F, D))
            down = src.take(f"{layer}{block}.experts.down_proj", (E, D, F))
            return {
                "w1": None if gate_up is None else gate_up[:, :F],
                "w3": None if gate_up is None else gate_up[:, F:],
                "w2": down,
            }
    default = (blocks[0], MIXTRAL_EXPERT_NAMES if model_type == "mixtral" else QWEN_EXPERT_NAMES)
    block, names = next(
        ((b, n) for b, n in styles if src.has(f"{layer}{b}.experts.0.{n[0][1]}.weight")), default
    )
    out: dict[str, torch.Tensor | None] = {}
    for ours, theirs in names:
        shape = (D, F) if ours == "w2" else (F, D)
        parts = [src.take(f"{layer}{block}.experts.{j}.{theirs}.weight", shape) for j in range(E)]
        out[ours] = None if any(p is None for p in parts) else torch.stack(parts)  # type: ignore[arg-type]
    return out


def _moe_block_name(src: _Source, layer: str, model_type: str) -> str:
    if model_type == "mixtral" and not src.has(f"{layer}mlp.gate.weight"):
        return "block_sparse_moe"
    return "mlp"


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """A meshtron Transformer from a transformers checkpoint directory; strict about every tensor."""
    path = Path(path)
    hf_config = read_hf_config(path)
    cfg = config_from_hf(hf_config)
    model_type = hf_config["model_type"]
    tensors = _read_checkpoint(path)
    src = _Source(tensors)

    # A checkpoint without lm_head ties it to the embedding, as transformers does.
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    elif cfg.tie_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")
        if embed is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
            raise ValueError(
                "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                "set tie_word_embeddings=false in config.json to load a separate output head"
            )
        src.used.add("lm_head.weight")

    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    global_names = dict(GLOBAL_RENAMES)
    state: dict[str, torch.Tensor | None] = {}
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}."
        renames = layer_renames(model_type, _moe_block_name(src, layer, model_type))
        prefix = f"layers.{i}."
        for name in (n for n in expected if n.startswith(prefix)):
            suffix = name[len(prefix) :]
            if suffix.startswith("moe.experts."):
                continue
            state[name] = src.take(layer + renames[suffix], expected[name])
        if cfg.is_moe_layer(i):
            experts = _load_experts(src, layer, cfg, model_type)
            for w, tensor in experts.items():
                state[f"{prefix}moe.experts.{w}"] = tensor
    for name in (n for n in expected if not n.startswith("layers.")):
        state[name] = src.take(global_names[name], expected[name])

    # The checkpoint's MTP modules are not part of the model `load` gives (transformers ignores them too).
    unexpected = [
        k
        for k in tensors
        if k not in src.used and not IGNORED_KEY_PATTERN.search(k) and mtp_layer(k, cfg.n_layers) is None
    ]
    problems = []
    if src.missing:
        problems.append(f"missing tensors: {_names(src.missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if src.bad_shapes:
        problems.append(f"shape mismatches: {'; '.join(src.bad_shapes)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not fit a {model_type} model: " + " | ".join(problems))

    model.load_state_dict(
        {name: t.to(dtype).contiguous() for name, t in state.items() if t is not None},
        strict=True,
        assign=True,
    )
    model.rope_inv_freq = rope_inv_freq(cfg)  # the meta-device buffer holds no values
    for module in model.modules():  # nor do the MoE layers' load counters (not state): none counted yet
        if isinstance(module, MoE):
            module.loads_2E = torch.zeros(module.loads_2E.shape)
    return model.eval()


def stored_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of `model` stores, in the order an export writes it: the parameters, then the
    routers' correction biases (buffers, learned by the bias step)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes |= {name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith("expert_bias")}
    return shapes


def hf_entries(cfg: ModelConfig, dtype: str = "float32") -> tuple[dict, list[Entry]]:
    """The transformers config.json dict of `cfg`, and its checkpoint's tensors in the classic HF names
    (per-expert tensors), each with the meshtron parameter it comes from (shapes from a meta build)."""
    hf_config = config_to_hf(cfg, dtype)
    model_type = hf_config["model_type"]
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    expert_names = dict(MIXTRAL_EXPERT_NAMES if model_type == "mixtral" else QWEN_EXPERT_NAMES)
    renames = layer_renames(model_type, block)
    global_names = dict(GLOBAL_RENAMES)
    with torch.device("meta"):
        shapes = stored_shapes(Transformer(cfg))
    entries = []
    for k in range(cfg.mtp_depth):  # DeepSeek's copies of the shared embedding and head in each module
        for theirs, ours in MTP_COPIES.items():
            source = "tok_embeddings.weight" if cfg.tie_embeddings else ours
            entries.append(Entry(f"model.layers.{cfg.n_layers + k}.{theirs}", shapes[source], source))
    for name, shape in shapes.items():
        location = block_location(name, cfg.n_layers)
        if location is None:
            entries.append(
                Entry(
                    mtp_name(name, cfg.n_layers) if name.startswith("mtp.") else global_names[name],
                    shape,
                    name,
                )
            )
            continue
        layer, suffix = location
        if suffix.startswith("moe.experts."):
            w = suffix.rsplit(".", 1)[1]
            expert = f"{layer}{block}.experts.{{}}.{expert_names[w]}.weight"
            entries += [Entry(expert.format(j), shape[1:], name, j) for j in range(shape[0])]
        else:
            entries.append(Entry(layer + renames[suffix], shape, name))
    return hf_config, entries


def hf_state_dict(model: Transformer) -> tuple[dict, dict[str, torch.Tensor]]:
    """The transformers config.json dict and state dict (classic HF names, per-expert tensors, on CPU,
    each tensor its own storage) of a plain single-device model."""
    dtype = next(model.parameters()).dtype
    hf_config, entries = hf_entries(model.cfg, str(dtype).removeprefix("torch."))
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    # Clones: safetensors refuses tensors that share storage (tied weights, per-expert views).
    return hf_config, {
        e.name: (params[e.source] if e.part is None else params[e.source][e.part]).detach().to("cpu").clone()
        for e in entries
    }


def save_streamed_model(
    cfg: ModelConfig,
    read: Callable[[str], torch.Tensor],
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write config.json and the weights (`read(name)`: meshtron parameter `name`, asked for one at a
    time) as a directory transformers loads: model.safetensors, or shards and their index past
    `max_shard_bytes` (stream.py)."""
    path = Path(path)
    stale = [
        p
        for p in (path / INDEX_FILE, path / SINGLE_FILE, *path.glob("model-*-of-*.safetensors"))
        if p.exists()
    ]
    if stale:
        raise FileExistsError(f"{path} holds weights already ({stale[0].name}); export to a new directory")
    hf_config, entries = hf_entries(cfg, str(dtype).removeprefix("torch."))
    path.mkdir(parents=True, exist_ok=True)
    save_streamed(path, entries, dtype, read, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def save_model(model: Transformer, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write a plain single-device model as a directory transformers loads (save_streamed_model)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    dtype = next(model.parameters()).dtype
    save_streamed_model(model.cfg, lambda name: params[name], path, dtype, max_shard_bytes)
