"""Configuration as data: the dataclass sections and each field's own range and options (loading.py reads
TOML files and `--section.key=value` overrides into them).

A field's range sits on the field (`positive(...)`), enumerated options are `Literal` types, and
rules/checks.py's `field_problems` reports both. How the options must fit the model, the world size and each
other is each feature's rule, stated in its subject's torch-free module of rules/ and gathered by rules/checks.py,
which also loads a config with `model.init_from` (the checkpoint's architecture) and raises every
problem at once.
Nothing here imports a feature.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from meshtron.config.layout import ParallelDims, absorbed_dp_shard
from meshtron.utils.words import plural

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised only on Python 3.10
    pass


class ConfigError(ValueError):
    """A user error in a config: the message lists every problem and how to fix it."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({plural(len(self.problems), 'problem')}):\n{lines}")


def refuse(problems: Sequence[str]) -> None:
    """Raise ConfigError listing `problems`, if there are any."""
    if problems:
        raise ConfigError(problems)


# The enumerated options; modules that act on them read their names from here (typing.get_args).
DType = Literal["fp32", "bf16"]
TrainingDType = Literal["fp32", "bf16", "fp8"]  # fp8: bf16 autocast, float8 projections (parallel/float8.py)
Float8Recipe = Literal["tensorwise", "rowwise"]  # the scale groups of training.dtype = "fp8"
RopeScaling = Literal["none", "llama3", "yarn"]
RouterScore = Literal["softmax", "sigmoid"]
ZeroStage = Literal[1, 2, 3]  # what dp_shard shards: 1 optimizer state, 2 + gradients, 3 + parameters
# ZeRO-3 implementation: meshtron's unit hooks, PyTorch's fully_shard, or SimpleFSDP's parametrization
FsdpImpl = Literal["meshtron", "torch", "simple"]
CpImpl = Literal["ring", "allgather", "alltoall", "hybrid"]
# What context parallel's ring and all-gather send of MLA: every head's keys and values, or the latents
# (parallel/context_latent.py); "auto": the planner's choice.
CpExchange = Literal["auto", "kv", "latent"]
EpDispatch = Literal[
    "alltoall", "dedup", "hierarchical", "allgather"
]  # how tokens reach the experts of other ep ranks
BalanceLoss = Literal["micro_batch", "sequence"]  # Switch/GShard over the micro-batch, or DeepSeek-V3's
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"]
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank placed in a V: parallel.vpp = 2, implied
SPLIT_BACKWARD = ("zero_bubble", *V_SCHEDULES)  # backward split into input (B) and weight (W) gradients
PipelineBalance = Literal["layers", "cost"]  # pipeline split: even layer counts, or by predicted FLOPs
Recompute = Literal["none", "selective", "op", "full"]
# What training.recompute="op" keeps: every matmul's output, every other one's, or every one's but MLA's
# up-projections (DeepSeek-V3's recipe, report §3.3.1).
OpRecomputeSaves = Literal["matmuls", "every_other_matmul", "matmuls_but_mla_up"]
OpRecomputeDispatch = Literal["keep", "rerun"]
OptimizerName = Literal["adamw", "muon"]  # muon: Muon on the blocks' matrices, AdamW on the rest
MuonLrRule = Literal["match_rms_adamw", "original"]  # the scale of Muon's update (train/muon.py)
Device = Literal["auto", "cpu", "cuda"]
CorpusTokenizer = Literal["bpe", "byte"]


def _ranged(default: Any, ok: Callable[[Any], bool], says: str, size: bool = False) -> Any:
    """A field whose value must satisfy `ok`; `says` completes "<section.key>=<value> ..." otherwise.
    `size`: a degree or size the feature rules divide by, so they wait until it is valid."""
    return field(default=default, metadata={"ok": ok, "says": says, "size": size})


def positive(default: float) -> Any:
    return _ranged(default, lambda v: v > 0, "must be positive", size=True)


def non_negative(default: float) -> Any:
    return _ranged(default, lambda v: v >= 0, "must be >= 0")


@dataclass(kw_only=True)
class ModelConfig:
    name: str = ""
    # A Hugging Face checkpoint directory (config.json + safetensors) to start from: the architecture
    # comes from its config.json, explicit keys may only repeat it, and the weights load into any layout
    # unless the run resumes from a checkpoint of its own (hf/init_from.py).
    init_from: str = ""
    dim: int = positive(256)
    n_layers: int = positive(4)
    n_heads: int = positive(8)
    n_kv_heads: int = non_negative(0)  # 0: same as n_heads (multi-head attention)
    head_dim: int = non_negative(0)  # 0: dim // n_heads
    ffn_dim: int = positive(768)
    vocab_size: int = positive(4096)
    rope_theta: float = positive(10000.0)
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = positive(1e-5)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = non_negative(0)  # 0: full causal attention
    # YaRN (rope_scaling = "yarn", Peng et al. 2023, DeepSeek-V2/V3): rope_scaling_factor and
    # rope_original_max_position as for llama3, the ramp's rotations and the attention temperatures.
    rope_beta_fast: float = positive(32.0)
    rope_beta_slow: float = positive(1.0)
    rope_mscale: float = non_negative(1.0)
    rope_mscale_all_dim: float = non_negative(0.0)  # > 0: the softmax scale times mscale(factor, this)²
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them
    # Multi-head latent attention (DeepSeek-V2/V3; models/latent_attention.py), on when kv_lora_rank > 0:
    # each token's keys and values are up-projected from one latent of kv_lora_rank values, plus one
    # rotary key of qk_rope_head_dim that all heads share; queries through a q_lora_rank latent (0: a
    # full projection). n_kv_heads and head_dim do not apply.
    kv_lora_rank: int = non_negative(0)
    q_lora_rank: int = non_negative(0)
    qk_nope_head_dim: int = non_negative(0)  # a head's query/key dims without rotary embedding
    qk_rope_head_dim: int = non_negative(0)  # ...and with it (the shared rotary key's size)
    v_head_dim: int = non_negative(0)  # a head's value (and output) size
    # Multi-token prediction (DeepSeek-V3, models/mtp.py): modules predicting 2..mtp_depth+1 tokens ahead.
    mtp_depth: int = non_negative(0)
    init_std: float = positive(0.02)
    # Mixture of experts; n_experts == 0 means a dense model.
    n_experts: int = non_negative(0)
    top_k: int = 2
    moe_ffn_dim: int = non_negative(0)  # 0: ffn_dim
    n_shared_experts: int = non_negative(0)
    shared_ffn_dim: int = non_negative(0)  # 0: n_shared_experts * moe_ffn_dim
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert output
    capacity_factor: float = non_negative(0.0)  # 0: dropless
    router: RouterScore = "softmax"
    router_norm_topk: bool = True  # renormalise the top-k weights to sum to 1
    router_scale: float = positive(1.0)  # gate weights multiplied by this (DeepSeek-V3: 2.5)
    n_expert_groups: int = positive(1)  # group-limited routing: experts in this many groups...
    topk_expert_groups: int = positive(1)  # ...of which each token may use the best this many
    aux_loss_coef: float = non_negative(0.01)
    balance_loss: BalanceLoss = "micro_batch"
    z_loss_coef: float = non_negative(0.0)
    # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for the top-k
    # choice only, moves by this much per optimizer step towards an even load; 0: off.
    router_bias_rate: float = non_negative(0.0)
    # The router keeps that bias (a checkpoint's e_score_correction_bias) even when it does not move.
    router_bias: bool = False
    moe_every: int = 1  # every k-th layer is MoE (Qwen2-MoE decoder_sparse_step)
    dense_layers: list[int] = field(default_factory=list)  # layers forced dense (mlp_only_layers)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads: under MLA every query head has its own (up-projected from the latent)."""
        return self.n_heads if self.is_mla else self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """A head's query/key size (under MLA its unrotated and rotary parts together)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.dim // self.n_heads

    @property
    def value_size(self) -> int:
        """A head's value (and attention output) size."""
        return self.v_head_dim if self.is_mla else self.head_size

    @property
    def rope_size(self) -> int:
        """The dims of a head the rotary embedding turns: MLA's rotary part, else the whole head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_size

    @property
    def has_expert_bias(self) -> bool:
        return self.router_bias or self.router_bias_rate > 0

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads a tensor-parallel rank holds: its 1/tp of them, or the one its query heads
        read when there are fewer than tp (tensor parallel replicates them)."""
        return self.kv_heads // tp if self.kv_heads % tp == 0 else 1

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


@dataclass(kw_only=True)
class ParallelConfig:
    # `meshtron train`: the planner picks every layout key not set explicitly (commands/auto_layout.py)
    auto: bool = False
    dp_replicate: int = positive(1)
    # -1: whatever the world size leaves after the other dims.
    dp_shard: int = _ranged(
        -1, lambda v: v == -1 or v > 0, "must be positive, or -1 to absorb the world size", size=True
    )
    zero: ZeroStage = 3
    bucket_mb: float = positive(25.0)  # gradient bucket size for DDP and ZeRO-1/2
    reduce_dtype: DType = "fp32"  # dtype of gradient reductions
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each unit's forward
    fsdp_impl: FsdpImpl = "meshtron"
    tp: int = positive(1)
    sp: bool = False
    cp: int = positive(1)
    cp_impl: CpImpl = "ring"
    cp_ulysses: int = positive(1)  # cp_impl="hybrid": the all-to-all ranks inside each ring rank
    cp_exchange: CpExchange = "auto"  # MLA under a ring or all-gather: keys and values, or latents
    pp: int = positive(1)
    pp_schedule: PipelineSchedule = "1f1b"
    vpp: int = positive(1)
    # Transformer layers of each pipeline chunk (pp*vpp entries, in chunk order); empty: balanced, with
    # the embedding and the head + loss counted as pp_embedding_layers / pp_head_layers layers of work.
    pp_layers: list[int] = field(default_factory=list)
    pp_embedding_layers: float = non_negative(0.0)
    pp_head_layers: float = non_negative(0.0)
    pp_balance: PipelineBalance = "layers"  # "cost": minimise the busiest rank's FLOPs (docs/pipeline.md)
    # dualpipev: each F&B pair's forward in a second thread while its backward runs (docs/pipeline.md)
    pp_overlap: bool = False
    ep: int = positive(1)
    ep_dispatch: EpDispatch = "alltoall"
    # Expert tensor parallel: 0 or tp (every expert split over tp like the FFN), or 1 (whole experts; ep may
    # then take tp ranks too: config/layout.py's expert grid).
    etp: int = non_negative(0)

    @property
    def expert_tp(self) -> bool:
        """Whether experts are split over tensor parallel (etp = tp) rather than kept whole (etp = 1)."""
        return self.etp in (0, self.tp)

    @property
    def experts_apart(self) -> bool:
        """Whether the experts have a grid of their own (config/layout.py), and so an engine of their own
        over edp: ep > 1, or whole experts over the tp ranks (etp = 1)."""
        return self.ep > 1 or not self.expert_tp

    def edp_of(self, shard: int) -> int:
        """The experts' data-parallel degree when `shard` = dp_shard x cp: the stage's ranks over ep x etp."""
        return shard * (1 if self.expert_tp else self.tp) // self.ep

    @property
    def cp_split(self) -> tuple[int, int]:
        """(ring degree, Ulysses degree) of context parallel: ring·ulysses = cp."""
        if self.cp_impl == "alltoall":
            return 1, self.cp
        if self.cp_impl == "hybrid" and self.cp_ulysses > 0 and self.cp % self.cp_ulysses == 0:
            return self.cp // self.cp_ulysses, self.cp_ulysses
        return self.cp, 1

    def dp_shard_for(self, world_size: int) -> int:
        """dp_shard in a job of `world_size` ranks (-1 resolved to what the other dims leave); lenient, for
        rules that run before the layout is known to be valid."""
        return absorbed_dp_shard(self.dp_shard, self.pp * self.dp_replicate * self.cp * self.tp, world_size)

    def dp_for(self, world_size: int) -> int:
        """The ranks that split the batch (dp_replicate x dp_shard) in a job of `world_size` ranks."""
        return self.dp_replicate * self.dp_shard_for(world_size)

    def dims(self, world_size: int) -> ParallelDims:
        """The degrees of a job of `world_size` ranks; ValueError for degrees that are not a layout."""
        return ParallelDims(
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard_for(world_size),
            cp=self.cp,
            tp=self.tp,
            ep=self.ep,
            etp=self.etp,
            cp_ulysses=self.cp_ulysses if self.cp_impl == "hybrid" else 1,
        )


@dataclass(kw_only=True)
class TrainingConfig:
    steps: int = positive(100)
    global_batch: int = positive(8)
    micro_batch: int = positive(8)
    seq_len: int = positive(256)
    lr: float = positive(3e-4)
    min_lr_ratio: float = _ranged(0.1, lambda v: 0.0 <= v <= 1.0, "must be between 0 and 1")
    warmup_steps: int = non_negative(10)
    weight_decay: float = non_negative(0.1)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: OptimizerName = "adamw"
    muon_momentum: float = _ranged(0.95, lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
    muon_nesterov: bool = True
    muon_ns_steps: int = _ranged(5, lambda v: 1 <= v < 100, "must be between 1 and 99 Newton-Schulz steps")
    muon_adjust_lr: MuonLrRule = "match_rms_adamw"  # "match_rms_adamw": one training.lr serves both
    muon_ns_dtype: DType = "bf16"  # Newton-Schulz's dtype: bf16 as torch.optim.Muon, or fp32
    seed: int = 0
    dtype: TrainingDType = "fp32"
    fp8_recipe: Float8Recipe = "tensorwise"
    fp8_all_gather: bool = False  # ZeRO-3 gathers the float8 layers' weights in e4m3 (docs/float8.md)
    grad_clip: float = non_negative(1.0)  # 0: no clipping
    max_skipped_steps: int = non_negative(5)  # non-finite steps in a row (each skipped) that stop a run
    recompute: Recompute = "none"
    op_recompute_saves: OpRecomputeSaves = "matmuls"  # what recompute="op" keeps (parallel/recompute.py)
    # recompute="op" under ep: keep what the expert dispatch delivered (memory) or send it again (network)
    op_recompute_dispatch: OpRecomputeDispatch = "keep"
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    eval_every: int = non_negative(0)  # steps between validation losses (and after the last step); 0: never
    eval_batches: int = positive(1)  # global batches of the validation data each evaluation averages
    # Multi-token prediction's weight λ: the loss adds λ/D times the sum of the D depths' losses.
    mtp_loss_coef: float = non_negative(0.3)


@dataclass
class DataSource:
    """One source of a data mixture (`[[data.sources]]`): a prepared dataset and its share (normalised)."""

    path: str = ""
    weight: float = 1.0


@dataclass(kw_only=True)
class DataConfig:
    path: str = "default"  # a `meshtron prepare-data` output dir, or "default" (Python stdlib source)
    sources: list[DataSource] = field(default_factory=list)  # a mixture instead of path (data/mixture.py)
    document_mask: bool = False  # attention within each document of a packed window (models/documents.py)
    reset_positions: bool = True  # with document_mask: RoPE positions restart at 0 at every document
    tokenizer: CorpusTokenizer = "bpe"  # for the default corpus
    tokenizer_vocab: int = 4096  # BPE vocab trained on the default corpus
    # Validation data (data/validation.py): the tokens' last val_fraction held out, or a prepared dir
    val_fraction: float = _ranged(0.0, lambda v: 0.0 <= v < 1.0, "must be in [0, 1): the share held out")
    val_path: str = ""

    def __post_init__(self) -> None:
        if self.path == "":  # no path (`--data.path=` unsets one): the default
            self.path = "default"


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""  # "": <run.dir>/checkpoints
    every: int = non_negative(0)  # 0: never (a final checkpoint is still written when every > 0)
    resume: bool = False  # continue from the newest complete checkpoint in dir, if there is one
    keep: int = non_negative(2)  # newest checkpoints kept; 0 keeps all
    # Stage to host memory, write in the background (checkpoint/async_save.py); TOML key `async` too.
    async_save: bool = False


@dataclass(kw_only=True)
class FaultToleranceConfig:
    # Replica groups (train/fault_tolerance.py): each dp_replicate slice fails, restarts and heals from a
    # live one on its own (torchft), while the others keep training.
    enabled: bool = False
    # DiLoCo (train/diloco.py): the dp_replicate slices train on their own for this many steps, then take
    # one outer step together on their averaged weight change; 0: off (every step all-reduces gradients).
    diloco_every: int = non_negative(0)
    diloco_outer_lr: float = positive(0.7)  # the outer SGD's learning rate (DiLoCo's paper: 0.7)
    diloco_outer_momentum: float = _ranged(0.9, lambda v: 0 <= v < 1, "must be in [0, 1)")  # Nesterov


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # [first, last] (1-based) traced into run.dir/traces
    memory_history: bool = True  # on CUDA: the allocator's history of those steps, a snapshot per rank
    # A log interval's slowest rank is named when its compute time passes the median's by this share.
    straggler_threshold: float = non_negative(0.2)


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    log_every: int = positive(1)
    comm_timeout_s: float = positive(300.0)
    device: Device = "auto"
    plot: bool = True
    memory_check: bool = (
        True  # refuse a layout predicted to need >1.25x the memory (commands/memory_check.py)
    )
    sample_tokens: int = non_negative(40)  # greedy tokens printed at the end of a run (rank 0); 0: none
    wandb_project: str = ""  # Weights & Biases (the wandb extra): rank 0 logs the scalars here; "": off
    wandb_name: str = ""  # the W&B run's name; "": run.dir's last part
    # Ranks per node (rank r on node r // gpus_per_node), for the hierarchical expert dispatch's two hops;
    # 0: the launcher's ranks per host (LOCAL_WORLD_SIZE). Set below that to try nodes on one machine.
    gpus_per_node: int = non_negative(0)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
