"""The planner's compute terms, each timed alone on this GPU against what plan/compute_time.py charges for
it: one transformer layer of each published MoE run the planner is checked against (and one dense run as
the control), at that run's shapes on one rank of its published layout.

  term             what runs (one layer, one micro-batch, one rank)               the planner's seconds
  weight GEMMs     attention's projections, the dense FFN or the shared experts:   matmul_time per shape,
                   each [m,k]x[k,n] as forward (X·W), input gradient (dY·Wᵀ) and    once per pass
                   weight gradient (Xᵀ·dY)
  routed experts   the rank's E/ep experts at top_k·rows·ep/E rows each (balanced   the same
                   routing), the same three forms; a loop of GEMMs, and grouped
                   (torch._grouped_mm) where this torch has it
  FP8 GEMMs        the two rows above with torch._scaled_mm (per-tensor scales)     the same at matmul_fp8
                   on a GPU that has FP8 (runs published in FP8 only)               of the FP8 peak
  attention core   causal SDPA over the rank's heads, forward; forward + backward  attention_time, x1; x3
  permutation      the routed rows gathered in expert order, then weighted and     the routed rows'
                   summed back into an fp32 result (forward)                        bytes / (hbm · hbm_eff)
  router           the [rows, dim] x [dim, E] logits, their softmax and top-k       the logits' matmul_time
  whole layer      meshtron's own block, eager, forward + backward (bf16 autocast)  chunk_times of the same
                   as a one-layer model of the rank's cut (rank_layer), at the        model: embedding,
                   rank's tokens and at 64 tokens, where the device has almost       layer, head
                   nothing to do and the time is the host's (kernel launches)

The ratio measured / planner above 1 says the planner is optimistic about that kernel at that shape: what
docs/planner.md calls the Qwen3-30B miss (the planner is 36-55% fast on that model's 768-wide experts
and nowhere else) is decided here, term by term, on the first session that has a GPU. The whole-layer
rows test the hypothesis docs/planner.md draws from the published per-layer times (a floor of host
time per layer and micro-batch that the planner does not price): the 64-token row is that floor for
meshtron's own block, the other row says whether the layer at the rank's shape sits above it. Each term is
timed as the median of five batches of calls of at least 10 ms each, after two warm-up calls; a term
that cannot run here (an API this torch lacks, memory) says why in its row instead of failing the rest.

    python benchmarks/planner_terms.py                 # CUDA: its section of RESULTS.md (about a minute)
    python benchmarks/planner_terms.py --smoke --out -  # CPU, a tiny MoE, fp32 (CI: through gpu_check.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from planner_vs_published import Run, base_config, megatron_core_runs, moe_runs
from reporting import RESULTS, table, write_section

from meshtron.config.schema import Config
from meshtron.models.llama import build_meta_model
from meshtron.plan.compute_time import (
    Matmuls,
    Rates,
    attention_matmuls,
    chunk_times,
    expert_matmuls,
    matmul_time,
    routed_rows_moved,
    routed_shape,
)
from meshtron.plan.estimate import Cluster
from meshtron.plan.flops import keys_per_query
from meshtron.plan.hardware import accelerator, table_name
from meshtron.plan.layout import Layout
from meshtron.rules.checks import load_config

TITLE = "## The planner's compute terms timed on one GPU"
CONTROL = "MCore 70B"  # a dense run the planner holds within 2%: its terms say what "right" looks like
HEADER = "run | term | shape on one rank | measured ms | planner ms | measured / planner"
SMOKE = [  # a tiny fine-grained MoE: 16 experts of 32, top 4, a shared expert, ep 2
    "--model.name=tiny", "--model.n_experts=16", "--model.top_k=4", "--model.moe_ffn_dim=32",
    "--model.n_shared_experts=1", "--parallel.ep=2", "--parallel.dp_shard=2", "--training.seq_len=64",
    "--training.micro_batch=2",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One run's layer on one rank: its config (layout applied), the rates the planner prices it at (the
    compute dtype's and, for FP8 runs, the FP8 GEMMs'), and the device and dtype it is timed in."""

    name: str
    cfg: Config
    rates: Rates
    fp8_rates: Rates | None
    device: torch.device
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        t = self.cfg.training
        return t.micro_batch * t.seq_len // self.cfg.parallel.cp

    @property
    def moe_layer(self) -> int:
        m = self.cfg.model
        return next((i for i in range(m.n_layers) if m.is_moe_layer(i)), -1)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of one call of `fn` (see the module docstring)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, int(0.01 / max(time.perf_counter() - start, 1e-6)))
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def _three_forms(m: int, k: int, n: int, case: Case) -> list[Callable[[], object]]:
    """The forward, input-gradient and weight-gradient products of an [m,k]x[k,n] layer."""
    x, w, dy = (torch.randn(a, b, device=case.device, dtype=case.dtype) for a, b in ((m, k), (k, n), (m, n)))
    return [lambda: x @ w, lambda: dy @ w.t(), lambda: x.t() @ dy]


def _fp8_three_forms(m: int, k: int, n: int, case: Case) -> list[Callable[[], object]]:
    """The same three products as FP8 GEMMs with per-tensor scales (torch._scaled_mm: the left operand
    row-major, the right column-major, dimensions multiples of 16)."""
    fp8, one = torch.float8_e4m3fn, torch.ones((), device=case.device)

    def cast(a: int, b: int) -> torch.Tensor:
        return torch.randn(a, b, device=case.device).to(fp8)

    x, w_t, dy, x_t, dy_t = cast(m, k), cast(n, k), cast(m, n), cast(k, m), cast(n, m)
    w = w_t.t().contiguous().t()  # [n, k] row-major as the column-major right operand of dY·Wᵀ

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)

    return [lambda: mm(x, w_t.t()), lambda: mm(dy, w), lambda: mm(x_t, dy_t.t())]


def _round16(x: float) -> int:
    return max(16, 16 * round(x / 16))


def gemm_row(case: Case, term: str, shapes: Matmuls, fp8: bool = False) -> list[str]:
    """Weight GEMMs of `shapes` (m, k, n, count), each in its three forms: measured against the planner."""
    rates = case.fp8_rates if fp8 else case.rates
    forms = _fp8_three_forms if fp8 else _three_forms
    measured = planner = 0.0
    for m, k, n, count in shapes:
        m_, k_, n_ = (_round16(v) for v in (m, k, n)) if fp8 else (max(1, round(m)), int(k), int(n))
        measured += count * sum(timed(f, case.device) for f in forms(m_, k_, n_, case))
        planner += count * 3 * matmul_time(m, k, n, rates)
    shape = "; ".join(f"{c} x [{m:.0f},{k:.0f}]x[{k:.0f},{n:.0f}]" for m, k, n, c in shapes)
    return _row(case, term, shape, measured, planner)


def grouped_row(case: Case) -> list[str]:
    """The routed experts as grouped GEMMs (torch._grouped_mm: one kernel over the rank's experts)."""
    per_expert, width, local = routed_shape(case.cfg, case.rows, 1.0)
    rows, k = _round16(per_expert), case.cfg.model.dim
    offsets = torch.arange(1, local + 1, device=case.device, dtype=torch.int32) * rows
    measured = planner = 0.0
    for _, a, b, count in expert_matmuls(case.cfg, case.rows, 1.0)[:2]:  # gate and up, then down
        x = torch.randn(local * rows, a, device=case.device, dtype=case.dtype)
        w = torch.randn(local, a, b, device=case.device, dtype=case.dtype)
        dy = torch.randn(local * rows, b, device=case.device, dtype=case.dtype)
        forms = [
            lambda x=x, w=w: torch._grouped_mm(x, w, offs=offsets),
            lambda dy=dy, w=w: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offsets),
            lambda x=x, dy=dy: torch._grouped_mm(x.t(), dy, offs=offsets),
        ]
        measured += count // local * sum(timed(f, case.device) for f in forms)
        planner += count * 3 * matmul_time(per_expert, a, b, case.rates)
    shape = f"{local} experts x [{per_expert:.0f},{k}]x[{k},{width}] grouped"
    return _row(case, "routed experts, grouped", shape, measured, planner)


def attention_rows(case: Case) -> list[list[str]]:
    """The attention core, forward and forward + backward, against attention_time."""
    m, t, p = case.cfg.model, case.cfg.training, case.cfg.parallel
    heads, seq = m.n_heads // p.tp, t.seq_len // p.cp

    def make(dim: int) -> torch.Tensor:
        shape = (t.micro_batch, heads, seq, dim)
        return torch.randn(shape, device=case.device, dtype=case.dtype, requires_grad=True)

    q, k, v = make(m.head_size), make(m.head_size), make(m.value_size)
    grad = torch.randn(t.micro_batch, heads, seq, m.value_size, device=case.device, dtype=case.dtype)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> None:
        torch.autograd.backward(F.scaled_dot_product_attention(q, k, v, is_causal=True), grad)

    width = heads * (m.head_size + m.value_size)
    core = case.rates.attention_time(2.0 * width * keys_per_query(seq, m.sliding_window) * case.rows)
    shape = f"{heads} heads x {seq} tokens, head dim {m.head_size} / {m.value_size}"
    return [
        _row(case, "attention core, forward", shape, timed(forward, case.device), core),
        _row(case, "attention core, forward + backward", shape, timed(both, case.device), 3 * core),
    ]


def permutation_row(case: Case) -> list[str]:
    """The routed rows' permutation and weighted combine (forward) against one pass of the bytes the
    planner charges them (plan/compute_time.py routed_rows_moved)."""
    m, tp = case.cfg.model, case.cfg.parallel.tp
    moved = routed_rows_moved(case.cfg, case.moe_layer, case.rows)
    act = torch.tensor([], dtype=case.dtype).element_size()
    tokens = round(moved / (m.dim * (2 * act + 4)) / m.top_k)  # the tokens this rank routes
    x = torch.randn(tokens, m.dim, device=case.device, dtype=case.dtype)
    expert = torch.randint(0, m.n_experts, (tokens * m.top_k,), device=case.device)
    weight = torch.rand(tokens * m.top_k, 1, device=case.device)

    def permute_and_combine() -> torch.Tensor:
        order = expert.argsort()
        source = order // m.top_k
        rows = x.index_select(0, source)  # in expert order: what the dispatch sends
        out = torch.zeros(tokens, m.dim, device=case.device, dtype=torch.float32)
        return out.index_add_(0, source, rows.float() * weight[order])

    seconds = moved / (case.rates.hbm * case.rates.eff.hbm)
    per_rank = f" (1/{tp} per tp rank)" if tp > 1 else ""
    shape = f"{tokens} tokens x top {m.top_k} of {m.n_experts}, dim {m.dim}{per_rank}"
    measured = timed(permute_and_combine, case.device)
    return _row(case, "permutation and combine, forward", shape, measured, seconds)


def router_row(case: Case) -> list[str]:
    """The router's logits, softmax and top-k against the logits' matmul_time."""
    m = case.cfg.model
    x = torch.randn(case.rows, m.dim, device=case.device, dtype=case.dtype)
    w = torch.randn(m.dim, m.n_experts, device=case.device, dtype=case.dtype)

    def route() -> object:
        return torch.topk(torch.softmax((x @ w).float(), dim=-1), m.top_k, dim=-1)

    shape = f"[{case.rows},{m.dim}]x[{m.dim},{m.n_experts}], top {m.top_k}"
    logits = matmul_time(case.rows, m.dim, m.n_experts, case.rates)
    return _row(case, "router, forward", shape, timed(route, case.device), logits)


def rank_layer(case: Case, tokens: int) -> Config:
    """One rank's layer as a one-layer model on one device, for meshtron's own block: the heads and
    the dense or shared FFN cut by tp as the layout cuts them (the experts' width too where etp = tp),
    the rank's E/ep experts with top_k capped at their number and no expert groups, a 1,024-token
    vocabulary, one sequence of `tokens`. The planner prices this same model, so the two sides agree on
    the work even where it differs from the rank's (with etp = 1 a tp rank routes 1/tp of the tokens)."""
    m, p = case.cfg.model, case.cfg.parallel
    local = max(1, m.n_experts // p.ep) if m.is_moe else 0
    model = dataclasses.replace(
        m, n_layers=1, dense_layers=[], moe_every=1, mtp_depth=0, vocab_size=1024, tie_embeddings=False,
        n_heads=m.n_heads // p.tp, n_kv_heads=max(1, m.n_kv_heads // p.tp), head_dim=0 if m.is_mla else m.head_size,
        ffn_dim=m.ffn_dim // p.tp, n_experts=local, top_k=min(m.top_k, local), n_expert_groups=1,
        topk_expert_groups=1, moe_ffn_dim=m.expert_ffn_dim // (p.tp if p.expert_tp else 1),
        shared_ffn_dim=m.shared_expert_ffn_dim // p.tp if m.n_shared_experts else 0,
    )  # fmt: skip
    training = dataclasses.replace(case.cfg.training, micro_batch=1, seq_len=tokens, recompute="none")
    return dataclasses.replace(case.cfg, model=model, training=training, parallel=type(p)())


def layer_rows(case: Case) -> list[list[str]]:
    """meshtron's block, eager, forward + backward as a training step runs it (bf16 autocast over fp32
    weights), at the rank's tokens and at 64: a one-layer model (rank_layer) against the planner's
    seconds for the same model (embedding, layer, head). At 64 tokens the device has almost nothing to
    do, so the time is the host's: its kernel launches, which the planner does not price."""
    model = build_meta_model(rank_layer(case, case.rows).model, case.device).to_empty(device=case.device)
    model.reset_buffers(case.device)
    with torch.no_grad():  # random weights on the device itself (the time does not depend on their values)
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    autocast = torch.autocast(case.device.type, dtype=case.dtype, enabled=case.dtype != torch.float32)
    rows = []
    for tokens, term in ((case.rows, "one-layer model of the rank's cut, forward + backward"),
                         (64, "the same at 64 tokens: launches, the host's floor")):  # fmt: skip
        cfg = rank_layer(case, tokens)
        ids = torch.randint(0, cfg.model.vocab_size, (1, tokens), device=case.device)

        def step(ids: torch.Tensor = ids) -> None:
            with autocast:
                logits = model(ids)
            F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()

        m = cfg.model
        ffn = (
            f"{m.n_experts} experts of {m.expert_ffn_dim}, top {m.top_k}" if m.is_moe else f"FFN {m.ffn_dim}"
        )
        planner = chunk_times(cfg, [0], True, True, case.rates).total
        rows.append(
            _row(case, term, f"{tokens} tokens, {m.n_heads} heads, {ffn}", timed(step, case.device), planner)
        )
    return rows


def _row(case: Case, term: str, shape: str, measured: float, planner: float) -> list[str]:
    figures = [f"{measured * 1e3:.3f}", f"{planner * 1e3:.3f}", f"{measured / planner:.2f}"]
    return [case.name, term, shape, *figures]


def case_rows(case: Case) -> list[list[str]]:
    """Every term of one run's layer, each on its own (a term that fails says why)."""
    cfg, moe = case.cfg, case.moe_layer >= 0
    attention = [(a, k, n, 1) for a, k, n in attention_matmuls(cfg, case.rows)]
    m, tp = cfg.model, cfg.parallel.tp
    if moe:
        every = expert_matmuls(cfg, case.rows, 1.0)
        routed, shared = every[:2], every[2:]
    else:
        routed, shared = [], [(case.rows, m.dim, m.ffn_dim // tp, 2), (case.rows, m.ffn_dim // tp, m.dim, 1)]
    terms: list[tuple[str, Callable[[], list[list[str]]]]] = [
        ("attention projections", lambda: [gemm_row(case, "attention projections", attention)]),
        ("FFN", lambda: [gemm_row(case, "dense FFN or shared experts", shared)] if shared else []),
        ("attention core", lambda: attention_rows(case)),
    ]
    if moe:
        terms += [
            ("routed experts", lambda: [gemm_row(case, "routed experts, a loop of GEMMs", routed)]),
            ("grouped", lambda: [grouped_row(case)]),
            ("permutation", lambda: [permutation_row(case)]),
            ("router", lambda: [router_row(case)]),
        ]
    terms += [("whole layer", lambda: layer_rows(case))]
    if case.fp8_rates is not None:
        terms += [("fp8", lambda: [gemm_row(case, "attention projections, FP8", attention, True)])]
        if moe:
            terms += [("fp8 experts", lambda: [gemm_row(case, "routed experts, FP8 loop", routed, True)])]
    rows: list[list[str]] = []
    for term, run in terms:
        try:
            rows += run()
        except Exception as e:  # noqa: BLE001 - one term's failure must not cost the others' figures
            why = f"not measured: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append([case.name, term, why, "", "", ""])
        if case.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def published_cases(device: torch.device) -> list[Case]:
    """The MoE runs of benchmarks/planner_vs_published.py and its dense control, on this GPU's entry of
    the planner's table (the published runs' own GPUs may differ: the ratio is this GPU's)."""
    props = torch.cuda.get_device_properties(device)
    name = table_name(props.name, props.total_memory)
    if name is None:
        raise SystemExit(f"{props.name} has no entry in the planner's GPU table")
    gpu = accelerator(name)
    runs: list[Run] = [*moe_runs(), *(r for r in megatron_core_runs() if r.name == CONTROL)]
    cases = []
    for run in runs:
        if run.name.startswith("torchtitan"):  # the same model as MCore's Qwen3-30B row, another layout
            continue
        cfg = Layout(**run.layout).apply(base_config(run))
        fp8 = run.dtype == "fp8" and gpu.fp8_flops_per_s is not None
        bf16 = Cluster(gpu, run.gpus, "bf16").rates("bf16")
        fp8_rates = Cluster(gpu, run.gpus, "fp8").rates("bf16") if fp8 else None
        cases.append(Case(run.name, cfg, bf16, fp8_rates, device, torch.bfloat16))
    return cases


def smoke_case() -> Case:
    """A tiny MoE on the CPU in fp32, priced at a made-up CPU's rates (the rows exercise the code only)."""
    cpu = dataclasses.replace(accelerator("h100"), name="cpu", bf16_flops_per_s=1e11, hbm_bytes_per_s=2e10)
    rates = Cluster(cpu, 1, "bf16").rates("fp32")
    return Case("tiny MoE (smoke)", load_config(None, SMOKE), rates, None, torch.device("cpu"), torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny MoE, fp32 (CI's run)")
    parser.add_argument("--out", default=str(RESULTS), help="results file ('-': print only)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU path")
    started = time.perf_counter()
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    cases = [smoke_case()] if args.smoke else published_cases(device)
    rows = [row for case in cases for row in case_rows(case)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    facts = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {name}; torch {torch.__version__}; took "
        f"{time.perf_counter() - started:.0f} s",
        "one layer, one micro-batch, one rank of each run's published layout, bf16 unless the term says FP8; "
        "balanced routing; the planner's rates are this GPU's",
        f"reproduce: `python benchmarks/planner_terms.py{' --smoke' if args.smoke else ''}`",
    ]
    body = "\n".join(["\n".join(f"- {f}" for f in facts), "", *table(HEADER, rows)])
    print(body)
    if args.out != "-":
        write_section(Path(args.out), TITLE, "planner_terms.py", body + "\n")
    failed = [r for r in rows if r[2].startswith("not measured")]
    return 1 if args.smoke and failed else 0


if __name__ == "__main__":
    sys.exit(main())
