"""Seconds one rank computes per micro-batch: each layer's forward (F), input-gradient backward (B) and
weight-gradient backward (W), from the shapes and three rates.

  work                   time                                                      per pass
  a matmul [m,k]x[k,n]   max(2·m·k·n / (peak·matmul), 2·(m·k + k·n + m·n)·bytes / (hbm·hbm_eff))
                         a roofline: thin matmuls (tp cuts n or k) are memory-bound  F, B and W each one
  attention core         4·(q/tp)·keys·tokens / (peak·attention)                  F once, B twice
  elementwise work       passes·(activation bytes the layer keeps, and an MoE        F a quarter, B the rest
                         layer's routed rows moved) / (hbm·hbm_eff): norms, rotary,
                         SwiGLU's product, residuals, the loss read and write about
                         what the layer keeps for backward; the routed rows'
                         permutation and combine move each row's input and output
                         and its fp32 sum, which nothing keeps
  FP8 casts              FP8_CAST_BYTES·elements / (hbm·hbm_eff): each distinct GEMM     F inputs, B output
                         activation input, and each output gradient, cast with current   gradients
                         scaling (the weights' casts cached across micro-batches)
  recompute              full: the layer's F again in B; selective: the attention core's F again

Rows m: the rank's tokens of the micro-batch, micro_batch·seq_len/cp (a tp rank computes on all of
them: sequence parallel gathers before the column-parallel projections). Routed experts: at balanced
routing each rank's E/ep experts receive top_k·m rows in all (ep ranks each send top_k·m/ep), so each
local expert's matmul has top_k·m·ep/E rows; the busiest rank, which the step waits for, `imbalance`
times that (the max over mean of tokens per expert rank, 1 when balanced; meshtron reports it per step). The head is [m, dim] x [dim, vocab/tp].

The named rates (`ComputeEfficiency`) are the achievable shares of the datasheet peaks; docs/planner.md
says how they were calibrated on published runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config.schema import Config
from meshtron.plan.flops import keys_per_query
from meshtron.plan.gpu_memory import layer_bytes
from meshtron.plan.memory import head_activation_bytes


@dataclass(frozen=True)
class ComputeEfficiency:
    """Achievable shares of the peaks (calibrated: docs/planner.md#calibration)."""

    matmul: float = 0.60  # of the dense tensor-core peak, by a large bf16 GEMM (Hopper's; see below)
    attention: float = 0.40  # of the same peak, by a fused (flash) attention kernel, forward and backward
    hbm: float = 0.80  # of the HBM bandwidth, by elementwise kernels and thin GEMMs
    elementwise_passes: float = 4.0  # HBM trips per kept activation byte per step (1 F, 3 B)
    # Of the FP8 peak, by FP8 GEMMs as frameworks run them (scaled operands, their casts and transposes,
    # grouped expert GEMMs): FP8 buys 1.5x on the matmuls, not 2x (calibrated on the published FP8 runs)
    matmul_fp8: float = 0.45

    @classmethod
    def for_gpu(cls, name: str) -> ComputeEfficiency:
        """The constants for a GPU of the planner's table: the matmul share differs by generation."""
        return cls(matmul=MATMUL_EFFICIENCY.get(name, cls.matmul))


# A large bf16 GEMM's share of the dense peak by GPU generation, calibrated on the published runs
# (docs/planner.md#calibration: Megatron-Core's H100 table, Korthikanti et al.'s and Narayanan et al.'s
# A100 runs). Ampere sustains more of its datasheet peak than Hopper in those runs. B200 has no
# published run here: it takes Hopper's share, unverified.
MATMUL_EFFICIENCY = {
    "a100-40gb": 0.70,
    "a100-80gb": 0.70,
    "h100": 0.60,
    "h800": 0.60,
    "h200": 0.60,
    "b200": 0.60,
}


# HBM bytes per element an FP8 cast with current (per-tensor) scaling moves: its amax read (2), the read
# to scale (2), and the row-wise and column-wise FP8 copies (1 each) that the GEMMs and the weight
# gradient read (Transformer Engine's current scaling; torchao's tensor-wise dynamic scaling alike).
FP8_CAST_BYTES = 6.0


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What one GPU does per second: `peak` FLOP/s of the matmuls, `attention_peak` of the attention
    kernel (bf16 even when the linear layers run in fp8, as Float8 training does), `hbm` bytes/s, and
    the shares reached."""

    peak: float
    hbm: float
    eff: ComputeEfficiency
    dtype_bytes: int = 2  # the compute dtype's element size
    attention_peak: float = 0.0  # 0: `peak`

    def attention_time(self, flops: float) -> float:
        return flops / ((self.attention_peak or self.peak) * self.eff.attention)


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one layer (or chunk) for one micro-batch: forward, input gradient, weight gradient."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0

    def __add__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.f + other.f, self.b + other.b, self.w + other.w)

    def __sub__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.f - other.f, self.b - other.b, self.w - other.w)

    def __mul__(self, k: float) -> PassTimes:
        return PassTimes(self.f * k, self.b * k, self.w * k)

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


def matmul_time(m: float, k: float, n: float, rates: Rates) -> float:
    """One pass of an [m, k] x [k, n] product on the roofline."""
    flops = 2.0 * m * k * n / (rates.peak * rates.eff.matmul)
    traffic = (m * k + k * n + m * n) * rates.dtype_bytes / (rates.hbm * rates.eff.hbm)
    return max(flops, traffic)


def attention_matmuls(cfg: Config, rows: int) -> list[tuple[float, float, float]]:
    """(m, k, n) of the attention's weight matmuls on one tp rank: wq, wk, wv, wo, or MLA's down-
    projections (whole, on the latents' tokens: all of them, or this rank's under sp with q_lora_rank),
    up-projections and wo (its heads)."""
    m, p = cfg.model, cfg.parallel
    h, tp = m.dim, p.tp
    if not m.is_mla:
        q, kv = m.n_heads * m.head_size // tp, m.kv_heads_per_rank(tp) * m.head_size
        return [(rows, h, q), (rows, h, kv), (rows, h, kv), (rows, q, h)]
    heads, ql, C = m.n_heads // tp, m.q_lora_rank, m.kv_lora_rank
    down_rows = rows // tp if p.sp and ql else rows
    queries = (
        [(down_rows, h, ql), (rows, ql, heads * m.head_size)] if ql else [(rows, h, heads * m.head_size)]
    )
    keys = [(down_rows, h, C + m.qk_rope_head_dim), (rows, C, heads * (m.qk_nope_head_dim + m.v_head_dim))]
    return [*queries, *keys, (rows, heads * m.v_head_dim, h)]


def latent_exchange_matmuls(cfg: Config, rows: int) -> tuple[float, float]:
    """How many extra up-projection matmuls (forward, backward) a layer runs under cp_exchange = "latent":
    each of the cp − 1 blocks that arrive is up-projected (forward), and again with its two gradients'
    matmuls (backward), and the rank's own block is rerun in backward."""
    p = cfg.parallel
    if p.cp_exchange != "latent" or p.cp == 1 or not cfg.model.is_mla:
        return 0.0, 0.0
    return float(p.cp - 1), 3.0 * (p.cp - 1) + 1.0


Matmuls = list[tuple[float, float, float, int]]  # (m, k, n, how many of that shape)


def _layer_matmuls(cfg: Config, layer: int, rows: int, imbalance: float) -> Matmuls:
    """(m, k, n, count) of the weight matmuls of one layer on one tp rank (see the module docstring)."""
    m, tp = cfg.model, cfg.parallel.tp
    out = [(a, k, n, 1) for a, k, n in attention_matmuls(cfg, rows)]
    if not m.is_moe_layer(layer):
        f = m.ffn_dim // tp
        return out + [(rows, m.dim, f, 2), (rows, f, m.dim, 1)]
    return out + [(rows, m.dim, m.n_experts, 1)] + expert_matmuls(cfg, rows, imbalance)  # with the router


def routed_shape(cfg: Config, rows: int, imbalance: float) -> tuple[float, int, int]:
    """(rows each local expert multiplies, its width on this rank, local experts) of an MoE layer."""
    m, p = cfg.model, cfg.parallel
    # etp = tp: each expert split over tp, all tokens; etp = 1: whole experts, 1/tp of the tokens each.
    width, share = (m.expert_ffn_dim // p.tp, 1) if p.expert_tp else (m.expert_ffn_dim, p.tp)
    return imbalance * m.top_k * rows / share * p.ep / m.n_experts, width, m.n_experts // p.ep


def expert_matmuls(cfg: Config, rows: int, imbalance: float) -> Matmuls:
    """(m, k, n, count) of an MoE layer's routed and shared experts' matmuls on one tp rank."""
    m, h = cfg.model, cfg.model.dim
    per_expert, width, local = routed_shape(cfg, rows, imbalance)
    out = [(per_expert, h, width, 2 * local), (per_expert, width, h, local)]
    if m.n_shared_experts:
        s = m.shared_expert_ffn_dim // cfg.parallel.tp
        out += [(rows, h, s, 2), (rows, s, h, 1)]
    return out


def _matmuls_time(shapes: Matmuls, rates: Rates) -> float:
    return sum(count * matmul_time(a, k, n, rates) for a, k, n, count in shapes)


def fp8_cast_elements(cfg: Config, layer: int, rows: int, imbalance: float = 1.0) -> PassTimes:
    """Activation elements one layer casts to FP8 per micro-batch when its GEMMs run in FP8 (F: each
    distinct GEMM input once, the projections that read one input sharing its cast as fused QKV and
    gate-up layers do; B: each GEMM's output gradient), as (F, B) in a PassTimes. The weights' casts are
    taken as cached across a step's micro-batches, as Transformer Engine does; the router stays in
    higher precision."""
    attention, experts = _fp8_cast_parts(cfg, layer, rows, imbalance)
    return attention + experts


def _fp8_cast_parts(cfg: Config, layer: int, rows: int, imbalance: float) -> tuple[PassTimes, PassTimes]:
    """fp8_cast_elements split into the attention's (with a dense layer's FFN) and an MoE layer's
    experts'."""
    m, tp = cfg.model, cfg.parallel.tp
    attention = attention_matmuls(cfg, rows)
    # Which projections read the layer's input x beside the first: k and v (grouped-query attention), or
    # MLA's key/value down-projection beside its query's (or beside wq without a query latent).
    beside = {2 if m.q_lora_rank else 1} if m.is_mla else {1, 2}
    forward = sum(a * k for i, (a, k, _) in enumerate(attention) if i not in beside)
    mine = PassTimes(f=forward, b=sum(a * n for a, _, n in attention))
    if not m.is_moe_layer(layer):
        f = m.ffn_dim // tp
        return mine + PassTimes(f=rows * (m.dim + f), b=rows * (2 * f + m.dim)), PassTimes()
    per_expert, width, local = routed_shape(cfg, rows, imbalance)
    shared = m.shared_expert_ffn_dim // tp if m.n_shared_experts else 0
    forward = local * per_expert * (m.dim + width) + (rows * (m.dim + shared) if shared else 0)
    output_grads = sum(a * n * count for a, _, n, count in expert_matmuls(cfg, rows, imbalance))
    return mine, PassTimes(f=forward, b=output_grads)


def expert_times(cfg: Config, layer: int, rates: Rates, imbalance: float = 1.0) -> PassTimes:
    """The experts' share of `layer_times` for an MoE layer (zero for a dense one): their matmuls (F, B
    and W each once), their FP8 casts, and the elementwise passes over their rows (F a quarter, B the
    rest): what the routed rows' permutation and combine move, and what the experts keep (each row's
    input and the SwiGLU's gate, up and product; the shared experts' alike). The part of the layer
    between the dispatch and the combine; the rest (attention, router, norms, and any recompute) is what
    a schedule pairing one micro-batch's forward with another's backward can run while this layer's
    all-to-alls wait (comm_time.overlapped_ep)."""
    m = cfg.model
    if not m.is_moe_layer(layer):
        return PassTimes()
    rows = cfg.training.micro_batch * cfg.training.seq_len // cfg.parallel.cp
    gemm = _matmuls_time(expert_matmuls(cfg, rows, imbalance), rates)
    per_expert, width, local = routed_shape(cfg, rows, imbalance)
    shared = m.shared_expert_ffn_dim // cfg.parallel.tp if m.n_shared_experts else 0
    act = 2 if cfg.training.dtype != "fp32" else 4
    kept = (local * per_expert * (m.dim + 3 * width) + rows * 3 * shared) * act
    moved = routed_rows_moved(cfg, layer, rows) + kept
    elementwise = rates.eff.elementwise_passes * moved / (rates.hbm * rates.eff.hbm)
    casts = _fp8_cast_parts(cfg, layer, rows, imbalance)[1] * _fp8_cast_seconds(rates)
    return PassTimes(f=gemm + elementwise / 4 + casts.f, b=gemm + 3 * elementwise / 4 + casts.b, w=gemm)


def _op_rerun_matmuls(cfg: Config, rows: int, gemm: float, rates: Rates) -> float:
    """Seconds of the matmuls recompute = "op" runs again: none, about half, or MLA's up-projections
    (of this rank's heads)."""
    m, p, saves = cfg.model, cfg.parallel, cfg.training.op_recompute_saves
    if saves != "matmuls_but_mla_up":
        return gemm / 2 if saves == "every_other_matmul" else 0.0
    heads = m.n_heads // p.tp
    queries = matmul_time(rows, m.q_lora_rank, heads * m.head_size, rates) if m.q_lora_rank else 0.0
    keys = matmul_time(rows, m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), rates)
    return queries + keys


def routed_rows_moved(cfg: Config, layer: int, rows: int) -> float:
    """Bytes an MoE layer's routed rows move in its permutation and combine that the layer does not keep:
    each row's token written in expert order and its output read back (activation dtype), then summed
    into the token's fp32 result; 0 for a dense layer."""
    m, p = cfg.model, cfg.parallel
    if not m.is_moe_layer(layer):
        return 0.0
    act = 2 if cfg.training.dtype != "fp32" else 4
    routed = m.top_k * rows // (1 if p.expert_tp else p.tp)  # etp = 1: each tp rank routes 1/tp
    return routed * m.dim * (2 * act + 4)


def layer_times(cfg: Config, layer: int, rates: Rates, imbalance: float = 1.0) -> PassTimes:
    """F, B and W seconds of transformer layer `layer` for one micro-batch on one rank."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    rows = t.micro_batch * t.seq_len // p.cp
    gemm = _matmuls_time(_layer_matmuls(cfg, layer, rows, imbalance), rates)
    width = m.n_heads // p.tp * (m.head_size + m.value_size)  # QKᵀ over the key dims, softmax·V the value's
    keys = keys_per_query(t.seq_len, m.sliding_window)
    core = rates.attention_time(2.0 * width * keys * rows)
    kept = layer_bytes(cfg, layer, "none") + routed_rows_moved(cfg, layer, rows)
    elementwise = rates.eff.elementwise_passes * kept / (rates.hbm * rates.eff.hbm)
    casts = _fp8_cast_times(cfg, layer, rows, imbalance, rates)
    forward = gemm + core + elementwise / 4 + casts.f
    # "op": the block's forward again, its kept matmuls (and, without cp, attention) taken from the store
    rerun = elementwise / 4 + (core if p.cp > 1 else 0.0) + _op_rerun_matmuls(cfg, rows, gemm, rates)
    recompute = {"none": 0.0, "selective": core, "op": rerun, "full": forward}[t.recompute]
    up_f, up_b = latent_exchange_matmuls(cfg, rows)
    if up_f:  # the latents up-projected again per arriving block (parallel/context_latent.py)
        heads = m.n_heads // p.tp
        up = matmul_time(rows, m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), rates)
        forward, recompute = forward + up_f * up, recompute + (up_f * up if t.recompute == "full" else 0.0)
        backward = gemm + 2 * core + 3 * elementwise / 4 + casts.b + recompute + up_b * up
        return PassTimes(f=forward, b=backward, w=gemm)
    return PassTimes(f=forward, b=gemm + 2 * core + 3 * elementwise / 4 + casts.b + recompute, w=gemm)


def _fp8_cast_seconds(rates: Rates) -> float:
    """Seconds per element cast to FP8 when the GEMMs run in FP8, else 0 (nothing is cast)."""
    return FP8_CAST_BYTES / (rates.hbm * rates.eff.hbm) if rates.dtype_bytes == 1 else 0.0


def _fp8_cast_times(cfg: Config, layer: int, rows: int, imbalance: float, rates: Rates) -> PassTimes:
    """Seconds of the FP8 casts (fp8_cast_elements) when the GEMMs run in FP8, else none."""
    return fp8_cast_elements(cfg, layer, rows, imbalance) * _fp8_cast_seconds(rates)


def head_times(cfg: Config, rates: Rates) -> PassTimes:
    """The final norm, output head and loss of one micro-batch (the last chunk's extra work), and the
    multi-token prediction depths."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    rows = t.micro_batch * t.seq_len // p.cp
    vocab = -(-m.vocab_size // p.tp)
    gemm = matmul_time(rows, m.dim, vocab, rates)
    kept = head_activation_bytes(m, t.micro_batch, t.seq_len, tp=p.tp, sp=p.sp, cp=p.cp, dtype=t.dtype)
    elementwise = rates.eff.elementwise_passes * kept / (rates.hbm * rates.eff.hbm)
    head = PassTimes(f=gemm + elementwise / 4, b=gemm + 3 * elementwise / 4, w=gemm)
    if not m.mtp_depth:
        return head
    # Each multi-token prediction depth: its projection of [embedding; h], its block, the head again.
    projection = matmul_time(rows, 2 * m.dim, m.dim, rates)
    depth = head + layer_times(cfg, m.n_layers, rates) + PassTimes(f=projection, b=projection, w=projection)
    return head + depth * m.mtp_depth


def embedding_times(cfg: Config, rates: Rates) -> PassTimes:
    """The embedding lookup (a gather forward, a scatter-add backward): memory traffic only."""
    t, p = cfg.training, cfg.parallel
    nbytes = t.micro_batch * t.seq_len // p.cp * cfg.model.dim * 4
    return PassTimes(f=nbytes / rates.hbm, w=2 * nbytes / rates.hbm)


def chunk_times(
    cfg: Config, layers: list[int], first: bool, last: bool, rates: Rates, imbalance: float = 1.0
) -> PassTimes:
    """One pipeline chunk: its layers, plus the embedding on the first chunk and the head on the last."""
    total = PassTimes()
    moe = [layer for layer in layers if cfg.model.is_moe_layer(layer)]
    dense = [layer for layer in layers if not cfg.model.is_moe_layer(layer)]
    for kind in (moe, dense):  # the layers of a kind all cost the same
        if kind:
            total = total + layer_times(cfg, kind[0], rates, imbalance) * len(kind)
    if first:
        total = total + embedding_times(cfg, rates)
    if last:
        total = total + head_times(cfg, rates)
    return total
