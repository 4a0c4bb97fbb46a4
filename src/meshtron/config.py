"""Configuration: dataclass sections, TOML files with `--section.key=value` overrides, validation.

Every problem in a config is collected and reported at once, each with the change that fixes it,
before any process starts or any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A user error in a config: the message lists every problem and how to fix it."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


@dataclass
class ModelConfig:
    name: str = ""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0  # 0: same as n_heads (multi-head attention)
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 768
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # 0: full causal attention
    init_std: float = 0.02
    # Mixture of experts; n_experts == 0 means a dense model.
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0  # 0: ffn_dim
    n_shared_experts: int = 0
    shared_ffn_dim: int = 0  # 0: n_shared_experts * moe_ffn_dim
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert output
    capacity_factor: float = 0.0  # 0: dropless
    router: str = "softmax"  # softmax | sigmoid
    router_norm_topk: bool = True  # renormalise the top-k weights to sum to 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    moe_every: int = 1  # every k-th layer is MoE (Qwen2-MoE decoder_sparse_step)
    dense_layers: list[int] = field(default_factory=list)  # layers forced dense (mlp_only_layers)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def shared_expert_ffn_dim(self) -> int:
        return self.shared_ffn_dim or self.n_shared_experts * self.expert_ffn_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers and (layer + 1) % self.moe_every == 0


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other dims
    zero: int = 3  # what dp_shard shards: 1 optimizer state, 2 + grads, 3 + params
    bucket_mb: float = 25.0  # gradient bucket size for DDP and ZeRO-1/2
    reduce_dtype: str = "fp32"  # dtype of gradient reductions: fp32 | bf16
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each unit's forward
    fsdp_impl: str = "meshtron"  # ZeRO-3 implementation: meshtron | torch (PyTorch's fully_shard)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_impl: str = "ring"  # ring | alltoall
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble
    vpp: int = 1
    # Transformer layers of each pipeline chunk (pp*vpp entries, in chunk order); empty: balanced, with
    # the embedding and the head + loss counted as pp_embedding_layers / pp_head_layers layers of work.
    pp_layers: list[int] = field(default_factory=list)
    pp_embedding_layers: float = 0.0
    pp_head_layers: float = 0.0
    ep: int = 1


@dataclass
class TrainingConfig:
    steps: int = 100
    global_batch: int = 8
    micro_batch: int = 8
    seq_len: int = 256
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    dtype: str = "fp32"  # fp32 | bf16
    grad_clip: float = 1.0  # 0: no clipping
    recompute: str = "none"  # none | selective | full


@dataclass
class DataConfig:
    path: str = "default"  # a `meshtron prepare-data` output dir, or "default" (Python stdlib source)
    tokenizer: str = "bpe"  # for the default corpus: bpe | byte
    tokenizer_vocab: int = 4096  # BPE vocab trained on the default corpus


@dataclass
class CheckpointConfig:
    dir: str = ""  # "": <run.dir>/checkpoints
    every: int = 0  # 0: never (a final checkpoint is still written when every > 0)
    resume: bool = False  # continue from the newest complete checkpoint in dir, if there is one
    keep: int = 2  # newest checkpoints kept; 0 keeps all


@dataclass
class RunConfig:
    dir: str = "runs/default"
    log_every: int = 1
    comm_timeout_s: float = 300.0
    device: str = "auto"  # auto | cpu | cuda
    plot: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ENUMS: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {
        "model.rope_scaling": ("none", "llama3"),
        "model.router": ("softmax", "sigmoid"),
        "parallel.cp_impl": ("ring", "alltoall"),
        "parallel.reduce_dtype": ("fp32", "bf16"),
        "parallel.fsdp_impl": ("meshtron", "torch"),
        "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved", "zero_bubble"),
        "training.dtype": ("fp32", "bf16"),
        "training.recompute": ("none", "selective", "full"),
        "run.device": ("auto", "cpu", "cuda"),
        "data.tokenizer": ("bpe", "byte"),
    }
)


def model_preset(name: str) -> dict[str, Any]:
    """Architecture of a named model (published hyper-parameters); explicit keys override it."""
    llama3_rope = dict(
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
    )
    presets: dict[str, dict[str, Any]] = {
        "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=512),
        "tiny-moe": dict(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=176,
            vocab_size=512,
            n_experts=4,
            top_k=2,
            moe_ffn_dim=96,
            n_shared_experts=1,
        ),
        "llama3-1b": dict(
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            vocab_size=128256,
            tie_embeddings=True,
            **llama3_rope,
        ),
        "llama3-8b": dict(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, **llama3_rope
        ),
        "llama3-70b": dict(
            dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, **llama3_rope
        ),
        "llama3-405b": dict(
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            ffn_dim=53248,
            vocab_size=128256,
            **llama3_rope,
        ),
        "mixtral-8x7b": dict(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            vocab_size=32000,
            rope_theta=1e6,
            n_experts=8,
            top_k=2,
            router="softmax",
            router_norm_topk=True,
            aux_loss_coef=0.02,
        ),
    }
    if name not in presets:
        close = difflib.get_close_matches(name, presets, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            [f"model.name={name!r} is not a known preset{hint} (known: {', '.join(sorted(presets))})"]
        )
    return presets[name]


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Accept `value` for a field of type `tp`, or record why not."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{where} must be a list of {_type_name(item_tp)}, got {value!r}")
            return None
        return [_coerce(v, item_tp, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where} must be true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{where} must be an integer, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        problems.append(f"{where} must be a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{where} must be a string, got {value!r}")
        return None
    raise TypeError(f"unsupported config field type {tp!r} for {where}")


def _suggest(name: str, options: Sequence[str], list_known: bool = True) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(options)})" if list_known else ""


def parse_override(text: str) -> tuple[str, str, Any]:
    """`--section.key=value` -> (section, key, value); the value is read as a TOML literal when it is one."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(
            [f"override {text!r} must look like --section.key=value (e.g. --training.steps=20)"]
        )
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as `bf16` or a path
    return section, key, value


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            [
                f"config file {str(path)!r} does not exist; pass an existing .toml file "
                f"(presets live in configs/)"
            ]
        )
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"{path} is not valid TOML: {err}"]) from None


def build_config(raw: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Merge a TOML mapping, a model preset and overrides into a typed Config; type errors are collected."""
    problems: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    section_types = _field_types(Config)

    def put(section: str, key: str | None, value: Any, origin: str) -> None:
        if section not in sections:
            problems.append(f"unknown section [{section}] in {origin}{_suggest(section, list(sections))}")
            return
        if key is None:
            if not isinstance(value, Mapping):
                problems.append(f"[{section}] in {origin} must be a table of keys")
                return
            for k, v in value.items():
                put(section, k, v, origin)
            return
        merged.setdefault(section, {})[key] = value

    for section, value in raw.items():
        put(section, None, value, "the config file")
    for text in overrides:
        try:
            section, key, value = parse_override(text)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        put(section, key, value, f"override {text!r}")

    model_values = merged.get("model", {})
    preset_name = model_values.get("name", "")
    if preset_name:
        try:
            merged["model"] = {**model_preset(preset_name), **model_values}
        except ConfigError as err:
            problems.extend(err.problems)

    built: dict[str, Any] = {}
    for section, section_cls in section_types.items():
        types_of = _field_types(section_cls)
        kwargs: dict[str, Any] = {}
        for key, value in merged.get(section, {}).items():
            if key not in types_of:
                problems.append(f"unknown key {section}.{key}{_suggest(key, list(types_of))}")
                continue
            coerced = _coerce(value, types_of[key], f"{section}.{key}", problems)
            if coerced is not None:
                kwargs[key] = coerced
        built[section] = section_cls(**kwargs)
    if problems:
        raise ConfigError(problems)
    return Config(**built)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    raw = load_toml(path) if path is not None else {}
    return build_config(raw, overrides)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_dp_shard(parallel: ParallelConfig, world_size: int) -> int:
    """dp_shard=-1 takes whatever the world size leaves; otherwise it is as given."""
    if parallel.dp_shard != -1:
        return parallel.dp_shard
    others = parallel.pp * parallel.dp_replicate * parallel.cp * parallel.tp
    return max(world_size // others, 1) if others > 0 else 1


def validate(cfg: Config, world_size: int = 1) -> list[str]:
    """Every cross-field problem of `cfg` for a job of `world_size` ranks, each with its fix."""
    problems: list[str] = []
    m, p, t = cfg.model, cfg.parallel, cfg.training

    for section in (m, p, t):
        prefix = {ModelConfig: "model", ParallelConfig: "parallel", TrainingConfig: "training"}[type(section)]
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            where = f"{prefix}.{f.name}"
            if where in ENUMS and value not in ENUMS[where]:
                problems.append(
                    f"{where}={value!r} is not one of {', '.join(ENUMS[where])}"
                    f"{_suggest(str(value), ENUMS[where], list_known=False)}"
                )
    for where in ("run.device", "data.tokenizer"):
        section, key = where.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in ENUMS[where]:
            problems.append(f"{where}={value!r} is not one of {', '.join(ENUMS[where])}")

    positive = {
        "model.dim": m.dim,
        "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads,
        "model.ffn_dim": m.ffn_dim,
        "model.vocab_size": m.vocab_size,
        "model.rope_theta": m.rope_theta,
        "model.norm_eps": m.norm_eps,
        "model.init_std": m.init_std,
        "parallel.dp_replicate": p.dp_replicate,
        "parallel.bucket_mb": p.bucket_mb,
        "parallel.tp": p.tp,
        "parallel.cp": p.cp,
        "parallel.pp": p.pp,
        "parallel.vpp": p.vpp,
        "parallel.ep": p.ep,
        "training.steps": t.steps,
        "training.global_batch": t.global_batch,
        "training.micro_batch": t.micro_batch,
        "training.seq_len": t.seq_len,
        "training.lr": t.lr,
        "run.log_every": cfg.run.log_every,
        "run.comm_timeout_s": cfg.run.comm_timeout_s,
    }
    sizes_bad = [f"{where}={value} must be positive" for where, value in positive.items() if value <= 0]
    problems.extend(sizes_bad)
    non_negative = {
        "model.n_kv_heads": m.n_kv_heads,
        "model.head_dim": m.head_dim,
        "model.n_experts": m.n_experts,
        "model.moe_ffn_dim": m.moe_ffn_dim,
        "model.n_shared_experts": m.n_shared_experts,
        "model.shared_ffn_dim": m.shared_ffn_dim,
        "model.capacity_factor": m.capacity_factor,
        "model.sliding_window": m.sliding_window,
        "model.aux_loss_coef": m.aux_loss_coef,
        "model.z_loss_coef": m.z_loss_coef,
        "training.warmup_steps": t.warmup_steps,
        "training.weight_decay": t.weight_decay,
        "training.grad_clip": t.grad_clip,
        "checkpoint.every": cfg.checkpoint.every,
        "checkpoint.keep": cfg.checkpoint.keep,
    }
    for where, value in non_negative.items():
        if value < 0:
            problems.append(f"{where}={value} must be >= 0")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        problems.append(f"training.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    if p.dp_shard == 0 or p.dp_shard < -1:
        problems.append(f"parallel.dp_shard={p.dp_shard} must be positive, or -1 to absorb the world size")
        sizes_bad.append("dp_shard")
    if p.zero not in (1, 2, 3):
        problems.append(f"parallel.zero={p.zero} must be 1, 2 or 3")
    if sizes_bad:
        return problems  # the checks below divide by these sizes

    if m.head_dim == 0 and m.dim % m.n_heads:
        problems.append(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; "
            f"use n_heads in {_divisors(m.dim)} or set model.head_dim"
        )
    if m.head_size % 2:
        problems.append(
            f"head size {m.head_size} must be even for rotary embeddings; change model.dim, "
            "model.n_heads or model.head_dim"
        )
    if m.n_heads % m.kv_heads:
        problems.append(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            f"use n_kv_heads in {_divisors(m.n_heads)}"
        )
    if m.is_moe:
        if not 1 <= m.top_k <= m.n_experts:
            problems.append(f"model.top_k={m.top_k} must be between 1 and model.n_experts={m.n_experts}")
        if m.moe_every < 1:
            problems.append(f"model.moe_every={m.moe_every} must be >= 1")
        bad = [i for i in m.dense_layers if not 0 <= i < m.n_layers]
        if bad:
            problems.append(f"model.dense_layers {bad} are outside 0..{m.n_layers - 1}")
        if m.shared_expert_gate and m.n_shared_experts == 0:
            problems.append("model.shared_expert_gate=true needs model.n_shared_experts >= 1")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(
            "model.rope_high_freq_factor must exceed model.rope_low_freq_factor for llama3 scaling"
        )

    # Parallel layout against the world and the model.
    if p.dp_shard == -1:
        others = p.pp * p.dp_replicate * p.cp * p.tp
        if world_size % others:
            problems.append(
                f"world size {world_size} is not divisible by pp*dp_replicate*cp*tp={others}; "
                f"pick degrees whose product divides {world_size}"
            )
    dp_shard = resolve_dp_shard(p, world_size)
    product = p.pp * p.dp_replicate * dp_shard * p.cp * p.tp
    if product != world_size:
        problems.append(
            f"pp*dp_replicate*dp_shard*cp*tp = {p.pp}*{p.dp_replicate}*{dp_shard}*{p.cp}*{p.tp} "
            f"= {product} but the world size is {world_size}; set parallel.dp_shard=-1 to absorb "
            "the rest, or launch with --nproc " + str(product)
        )
    if m.n_heads % p.tp:
        problems.append(
            f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}; "
            f"use tp in {_divisors(m.n_heads)}"
        )
    elif m.kv_heads % p.tp and p.tp % m.kv_heads:
        problems.append(
            f"model.n_kv_heads={m.kv_heads} and parallel.tp={p.tp}: one must divide the other "
            "so key/value heads can be split or replicated"
        )
    if m.ffn_dim % p.tp:
        problems.append(
            f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={p.tp}; "
            f"use tp in {_divisors(m.ffn_dim)}"
        )
    if m.is_moe and m.n_shared_experts and m.shared_expert_ffn_dim % p.tp:
        problems.append(
            f"shared expert ffn dim {m.shared_expert_ffn_dim} is not divisible by parallel.tp={p.tp}"
        )
    if m.is_moe and m.expert_ffn_dim % p.tp:
        problems.append(f"expert ffn dim {m.expert_ffn_dim} is not divisible by parallel.tp={p.tp}")
    if p.sp and p.tp == 1:
        problems.append(
            "parallel.sp=true needs parallel.tp > 1 (sequence parallel splits along the tp group)"
        )
    if p.sp and t.seq_len % (p.tp * p.cp):
        problems.append(f"training.seq_len={t.seq_len} must be divisible by tp*cp={p.tp * p.cp} with sp")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        problems.append(
            f"training.seq_len={t.seq_len} must be divisible by 2*cp={2 * p.cp} "
            "(load-balanced causal context parallel gives each rank two chunks)"
        )
    if p.cp > 1 and p.cp_impl == "alltoall" and (m.n_heads % (p.tp * p.cp)):
        problems.append(
            f"cp_impl=alltoall needs model.n_heads={m.n_heads} divisible by tp*cp={p.tp * p.cp}; "
            "use cp_impl=ring"
        )
    stages = p.pp * p.vpp
    if p.pp_layers:
        if len(p.pp_layers) != stages or any(n < 1 for n in p.pp_layers) or sum(p.pp_layers) != m.n_layers:
            problems.append(
                f"parallel.pp_layers={p.pp_layers} must give pp*vpp={stages} positive layer counts "
                f"adding up to model.n_layers={m.n_layers}"
            )
    elif m.n_layers < stages:
        problems.append(
            f"model.n_layers={m.n_layers} cannot fill pp*vpp={stages} pipeline chunks; "
            f"use pp*vpp <= {m.n_layers}"
        )
    if p.pp_embedding_layers < 0 or p.pp_head_layers < 0:
        problems.append("parallel.pp_embedding_layers and parallel.pp_head_layers must be >= 0")
    elif p.pp_layers and (p.pp_embedding_layers or p.pp_head_layers):
        problems.append(
            "parallel.pp_layers gives the split explicitly; parallel.pp_embedding_layers and "
            "parallel.pp_head_layers only weigh a balanced split: set one or the other"
        )
    if p.vpp > 1 and p.pp_schedule != "interleaved":
        problems.append(f"parallel.vpp={p.vpp} needs parallel.pp_schedule='interleaved'")
    if p.pp_schedule == "interleaved" and p.pp > 1 and p.vpp < 2:
        problems.append("parallel.pp_schedule='interleaved' needs parallel.vpp >= 2")
    if p.ep > 1:
        if not m.is_moe:
            problems.append(f"parallel.ep={p.ep} needs an MoE model (model.n_experts > 0); set parallel.ep=1")
        else:
            if m.n_experts % p.ep:
                problems.append(
                    f"model.n_experts={m.n_experts} is not divisible by parallel.ep={p.ep}; "
                    f"use ep in {_divisors(m.n_experts)}"
                )
            if (dp_shard * p.cp) % p.ep:
                problems.append(
                    f"parallel.ep={p.ep} must divide dp_shard*cp={dp_shard * p.cp} "
                    "(experts borrow their ranks from the data- and context-parallel dims)"
                )
    dp = p.dp_replicate * dp_shard
    if t.global_batch % (t.micro_batch * dp):
        problems.append(
            f"training.global_batch={t.global_batch} is not divisible by micro_batch*dp = "
            f"{t.micro_batch}*{dp}; use a global_batch that is a multiple of {t.micro_batch * dp}"
        )
    elif p.pp > 1:
        microbatches = t.global_batch // (t.micro_batch * dp)
        if microbatches < p.pp:
            problems.append(
                f"{microbatches} micro-batch(es) per step cannot fill pp={p.pp} stages; "
                f"raise training.global_batch to at least {p.pp * t.micro_batch * dp}"
            )
        if p.pp_schedule == "interleaved" and microbatches % p.pp:
            problems.append(
                f"interleaved 1F1B needs micro-batches per step ({microbatches}) to be a multiple "
                f"of pp={p.pp}"
            )
    return problems


def check(cfg: Config, world_size: int = 1) -> Config:
    """Raise ConfigError listing every problem, or return cfg unchanged."""
    problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    return cfg
