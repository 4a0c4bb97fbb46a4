"""Activation memory a transformer layer keeps for backward, tensor by tensor.

Korthikanti et al. (2022) count, for a GPT layer in 16-bit with dropout and an unfused attention, the
tensors backward needs: s·b·h·(34 + 5·a·s/h) bytes, 34/t with tensor + sequence parallel, 2·s·b·h
with full recompute (docs/theory.md#activation-memory). The same accounting applied to meshtron's block (RMSNorm, rotary
embedding, a fused attention kernel, SwiGLU, no dropout) gives, per layer, in elements (times the
activation dtype's bytes), with t the tensor-parallel degree, q = n_heads·head_dim, k the key/value
width held per rank, f the FFN width:

  each RMSNorm      its input, the 1/rms statistic, the normalised x and the weighted output
                    3·s·b·h + s·b           (with sp: its input, statistic and normalised x are 1/t,
                                             and the all-gathered output, kept by the projections, is
                                             whole: 2·s·b·h/t + s·b/t + s·b·h)
  attention         rotated q and k, v, the kernel's output (which is also the output projection's
                    input) and its log-sum-exp: s·b·(2q/t + 2k) + b·(a/t)·s
  SwiGLU            gate and up projections, silu(gate), their product: 4·s·b·f/t
  full recompute    the block input only: s·b·h (s·b·h/t with sp)
  selective         rotary embedding and attention rerun: q and k before rotation are kept instead of
                    after (the same size), the log-sum-exp is not, and the kernel's output is kept anyway
                    as the output projection's input: minus b·(a/t)·s only. With a fused kernel there is
                    no score matrix left for selective recompute to drop.

Context parallel (cp ranks, each holding s/cp tokens of every sequence) divides every term by cp: its
attention keeps the same tensors for its own tokens (rotated q and k, v, the output, the log-sum-exp),
the exchanged K/V blocks are freed after each step and fetched again in backward. One exception: the
all-to-all implementations (Ulysses degree u) keep the attention output twice, head-split for their
own backward and sequence-split for the output projection's (s·b·q/t more), and with fewer key/value
heads per tp rank than u they keep k and v replicated to u heads.

The 5·a·s² score term is absent: the fused kernel never materialises the scores. Unlike Megatron, the
all-gathered input of the column-parallel projections is kept whole under sequence parallel rather than
gathered again in backward, so tp + sp keeps 2·s·b·h·(1 − 1/t) elements per layer more than a fully
sequence-sharded count would.
"""

from __future__ import annotations

from meshtron.config import ModelConfig, Recompute


def layer_activation_elements(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
    cp: int = 1,
    ulysses: int = 1,
) -> int:
    """Elements one dense transformer layer keeps for backward on one rank of tp x cp (`ulysses`: the
    all-to-all degree of context parallel, cp for cp_impl="alltoall")."""
    if cfg.is_moe:
        raise ValueError("the activation formula covers dense layers; MoE layers depend on the routing")
    seq //= cp
    sb, h, a = seq * batch, cfg.dim, cfg.n_heads
    q = cfg.n_heads * cfg.head_size
    kv_heads = cfg.kv_heads_per_rank(tp)
    if recompute == "full":
        return sb * h // tp if sp else sb * h
    norm = (2 * sb * h) // tp + sb // tp + sb * h if sp else 3 * sb * h + sb
    attention = sb * (2 * q // tp + 2 * kv_heads * cfg.head_size) + batch * (a // tp) * seq
    if ulysses > 1 and recompute == "none":  # (selective recompute keeps the inputs, before the exchange)
        # Ulysses keeps k and v with the key/value heads it had to replicate, and its output twice:
        # head-split for its own backward, sequence-split for the output projection's.
        attention += sb * (2 * (max(kv_heads, ulysses) - kv_heads) * cfg.head_size + q // tp)
    swiglu = 4 * sb * cfg.ffn_dim // tp
    total = 2 * norm + attention + swiglu
    if recompute == "selective":
        total -= batch * (a // tp) * seq
    return total


def korthikanti_bytes(
    cfg: ModelConfig, batch: int, seq: int, tp: int = 1, sp: bool = False, recompute: Recompute = "none"
) -> float:
    """The paper's 16-bit GPT-layer figure for the same sizes (docs/theory.md#activation-memory), for comparison."""
    sbh, a, s, h, t = seq * batch * cfg.dim, cfg.n_heads, seq, cfg.dim, tp
    if recompute == "full":
        return 2 * sbh
    attention_scores = 5 * a * s / (h * t)
    if recompute == "selective":
        return sbh * (34 / t if sp else 10 + 24 / t)
    if sp:
        return sbh * (34 / t + attention_scores)
    return sbh * (10 + 24 / t + attention_scores) if t > 1 else sbh * (34 + 5 * a * s / h)


def layer_activation_bytes(cfg: ModelConfig, batch: int, seq: int, dtype_bytes: int = 4, **kwargs) -> int:
    return layer_activation_elements(cfg, batch, seq, **kwargs) * dtype_bytes
