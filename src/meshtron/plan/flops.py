"""Model FLOPs of meshtron's decoder, per token and per layer, from the model's shapes alone.

A matrix multiply of n rows by an [a, b] weight costs 2·n·a·b FLOPs forward and twice that backward
(the input gradient and the weight gradient), so training costs 3 forward passes (Kaplan et al. 2020;
Narayanan et al. 2021a). Per token, forward, with h = dim, q = n_heads·head_size, k = kv_heads·head_size,
f the dense FFN width, f_e an expert's, f_s the shared experts' (together), E experts, K = top_k,
V the vocabulary and n the keys each query attends to on average:

  part                     forward FLOPs per token (per layer unless said)
  attention projections    2·(h·q + 2·h·k + q·h)          wq, wk, wv (grouped-query: k ≤ q), wo
                           MLA: 2·(h·q_l + q_l·H·Dk + h·(C + R) + C·H·(N + Dv) + H·Dv·h), its down-
                           projections to the latents, the heads' up-projections and wo (q_l = 0:
                           h·H·Dk for the queries)
  attention core           2·H·(Dk + Dv)·n                QKᵀ and softmax·V over n keys, all query heads
                                                          (Dk = Dv = head_dim but under MLA)
  FFN, dense layer         2·3·h·f                        SwiGLU: gate, up, down
  FFN, MoE layer           2·3·h·(K·f_e + f_s)            top_k routed experts and the shared experts
  router, MoE layer        2·h·E (+ 2·h)                  scores over E experts (+ a shared-expert gate)
  head                     2·h·V, once                    the output projection, tied or not
  MTP, per depth           2·2h·h + a layer + 2·h·V       its projection, block and the head again
  embedding                0                              a lookup
  training                 3 × the sum                    forward + backward (2×)

Which layers are MoE follows `ModelConfig.is_moe_layer`. Norms, biases, rotary embedding, softmax and the
loss are elementwise work and not counted (as in every published MFU). A dropping MoE (capacity_factor
> 0) still counts K experts per token: model FLOPs are the model's, not what the kernel skipped.

Keys per query (`keys_per_query`), for sequence length s and sliding window w (0: none):

  causal   the area of the causal triangle per query: s/2; with a window w < s, the band of width w under
           the diagonal, (s·w − w²/2)/s = w − w²/(2s) (s/2 again at w = s). This is the issue's MFU
           convention and Megatron-LM's/PaLM's causal half. The exact count of a discrete mask is
           (s + 1)/2, resp. w − w·(w − 1)/(2s): at most half a key more per query.
  full     twice the causal count: every key within the window on both sides, s per query without one.
           Megatron-LM's published TFLOP/s count the dense s×s score matrix this way.

Recompute (`recompute_flops_per_token`) runs part of the forward again in backward; it is not model FLOPs
(MFU leaves it out, Chowdhery et al. 2022) but the GPUs execute it:

  full        every layer's forward again (projections, core, FFN, router); the head is not recomputed
  op          the matmuls it does not keep (none, or about half with every_other_matmul) and, under
              context parallel, the attention core; the elementwise rest is not counted in FLOPs
  selective   the attention core only (QKᵀ and softmax·V; `Attention.core` in models/llama.py)

Check: a GPT block (MHA, FFN of 4h, i.e. f = 8h/3 with SwiGLU), full attention and full recompute gives
per step of B sequences 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)), Narayanan et al. (2021a)'s count.
Megatron-Core's own throughput counter (`num_floating_point_operations` in the Megatron-LM repository,
megatron/training/training.py, 2024), the one its training logs report TFLOP/s/GPU with, counts 3
passes, full attention, GQA and SwiGLU, no recompute and no router: 12·B·s·L·h²·(1 + g/a + (3/2)·f/h + s/h +
V/(2·L·h)) for g key/value groups of a heads, i.e. `training_flops_per_token(cfg, s, "full")` for a
dense model with head_size = h/a.

This is meshtron's one FLOP count: the trainer's MFU (train/trainer.py) and the planner both use
`training_flops_per_token`. tests/test_plan_flops_hardware.py checks it against the parameters of the
real model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from meshtron.config.schema import ModelConfig, OpRecomputeSaves, Recompute

AttentionCount = Literal["causal", "full"]
TRAINING_PASSES = 3  # forward + backward (input and weight gradients)


def keys_per_query(seq_len: int, window: int = 0, attention: AttentionCount = "causal") -> float:
    """Keys a query attends to, averaged over the s queries of a sequence (see the module docstring)."""
    s = float(seq_len)
    w = float(window) if 0 < window < seq_len else s
    causal = w - w * w / (2 * s)
    return causal if attention == "causal" else 2 * causal


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per token, by part (of one layer, some layers, or the whole model)."""

    attention_projections: float = 0.0
    attention_core: float = 0.0
    ffn: float = 0.0  # dense SwiGLU, or routed + shared experts
    router: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        """Forward FLOPs per token."""
        return self.attention_projections + self.attention_core + self.ffn + self.router + self.head

    @property
    def training(self) -> float:
        """Training (model) FLOPs per token: forward and backward, no recompute."""
        return TRAINING_PASSES * self.total

    def __add__(self, other: ModelFlops) -> ModelFlops:
        return ModelFlops(
            self.attention_projections + other.attention_projections,
            self.attention_core + other.attention_core,
            self.ffn + other.ffn,
            self.router + other.router,
            self.head + other.head,
        )


def projection_params(cfg: ModelConfig) -> int:
    """The weights one token's attention projections multiply with (one device): wq, wk, wv, wo, or MLA's
    down-projections to its latents, its up-projections and wo."""
    h, H = cfg.dim, cfg.n_heads
    if not cfg.is_mla:
        q, k = H * cfg.head_size, cfg.kv_heads * cfg.head_size
        return h * q + 2 * h * k + q * h
    ql, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    queries = h * ql + ql * H * cfg.head_size if ql else h * H * cfg.head_size
    keys = h * (C + R) + C * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return queries + keys + H * cfg.v_head_dim * h


def layer_flops(
    cfg: ModelConfig, layer: int, seq_len: int, attention: AttentionCount = "causal"
) -> ModelFlops:
    """Forward FLOPs per token of transformer layer `layer` (dense or MoE per `cfg.is_moe_layer`). The
    core: QKᵀ over the key dims and softmax·V over the value dims of every head (MLA's differ)."""
    h = cfg.dim
    projections = 2.0 * projection_params(cfg)
    width = cfg.n_heads * (cfg.head_size + cfg.value_size)
    core = 2.0 * width * keys_per_query(seq_len, cfg.sliding_window, attention)
    if not cfg.is_moe_layer(layer):
        return ModelFlops(projections, core, 2.0 * 3 * h * cfg.ffn_dim)
    experts = 2.0 * 3 * h * (cfg.top_k * cfg.expert_ffn_dim + cfg.shared_expert_ffn_dim)
    router = 2.0 * h * (cfg.n_experts + (1 if cfg.shared_expert_gate else 0))
    return ModelFlops(projections, core, experts, router)


def head_flops(cfg: ModelConfig, seq_len: int = 0, attention: AttentionCount = "causal") -> ModelFlops:
    """Forward FLOPs per token of the output head (the embedding lookup has none) and of the multi-token
    prediction depths behind it (models/mtp.py: each its projection of [embedding; h], one block and the
    head again), all on the last pipeline stage."""
    h = cfg.dim
    out = ModelFlops(head=2.0 * h * cfg.vocab_size * (1 + cfg.mtp_depth))
    for k in range(cfg.mtp_depth):
        out = out + layer_flops(cfg, cfg.n_layers + k, seq_len, attention) + ModelFlops(head=2.0 * 2 * h * h)
    return out


def model_flops(
    cfg: ModelConfig,
    seq_len: int,
    attention: AttentionCount = "causal",
    layers: Iterable[int] | None = None,
    head: bool = True,
) -> ModelFlops:
    """Forward FLOPs per token of `layers` (all by default) plus the head if `head`: the whole model, or
    one pipeline stage's share of it."""
    total = head_flops(cfg, seq_len, attention) if head else ModelFlops()
    for layer in range(cfg.n_layers) if layers is None else layers:
        total = total + layer_flops(cfg, layer, seq_len, attention)
    return total


def head_layers(cfg: ModelConfig, seq_len: int) -> float:
    """The output head's FLOPs in average layers (to one decimal): how many layers' worth of work the
    last pipeline stage's head is, for a split that balances the stages (parallel.pp_head_layers)."""
    layers = model_flops(cfg, seq_len, head=False).total / cfg.n_layers
    return round(head_flops(cfg, seq_len).total / layers, 1)


def training_flops_per_token(cfg: ModelConfig, seq_len: int, attention: AttentionCount = "causal") -> float:
    """Model FLOPs per trained token (the MFU numerator): 3 forward passes of the whole model."""
    return model_flops(cfg, seq_len, attention).training


def mla_up_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one layer's MLA up-projections (0 without MLA): the queries' from their
    latent and the keys' and values' from theirs, 2 FLOPs per multiply-add."""
    if not cfg.is_mla:
        return 0.0
    q = cfg.q_lora_rank * cfg.n_heads * cfg.head_size
    kv = cfg.kv_lora_rank * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return 2.0 * (q + kv)


def recompute_flops_per_token(
    cfg: ModelConfig,
    seq_len: int,
    recompute: Recompute,
    attention: AttentionCount = "causal",
    layers: Iterable[int] | None = None,
    cp: int = 1,
    op_saves: OpRecomputeSaves = "matmuls",
) -> float:
    """Extra forward FLOPs per token that activation recompute runs in backward, over `layers` (all by
    default): a whole block's forward with "full", the attention core with "selective", none with "none";
    with "op" the matmuls it does not keep (half of them with every_other_matmul, about; MLA's
    up-projections with matmuls_but_mla_up) and, under context parallel, the attention core."""
    if recompute == "none":
        return 0.0
    layers = list(range(cfg.n_layers) if layers is None else layers)  # (read twice below)
    blocks = model_flops(cfg, seq_len, attention, layers, head=False)
    if recompute == "op":
        matmuls = blocks.attention_projections + blocks.ffn + blocks.router
        rerun = {
            "matmuls": 0.0,
            "every_other_matmul": matmuls / 2,
            "matmuls_but_mla_up": mla_up_flops_per_token(cfg) * len(layers),
        }[op_saves]
        return rerun + (blocks.attention_core if cp > 1 else 0.0)
    return blocks.total if recompute == "full" else blocks.attention_core


def executed_flops_per_token(
    cfg: ModelConfig, seq_len: int, recompute: Recompute, attention: AttentionCount = "causal"
) -> float:
    """FLOPs the GPUs run per token: the model's training FLOPs plus recompute (hardware FLOPs)."""
    return training_flops_per_token(cfg, seq_len, attention) + recompute_flops_per_token(
        cfg, seq_len, recompute, attention
    )


def layer_costs(m: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(training FLOPs per token of each layer, of the embedding, of the head and loss)."""
    layers = [TRAINING_PASSES * layer_flops(m, i, seq_len).total for i in range(m.n_layers)]
    embedding = TRAINING_PASSES * m.dim
    head = TRAINING_PASSES * (head_flops(m, seq_len).total + 3 * m.vocab_size * (1 + m.mtp_depth))
    return layers, embedding, head
