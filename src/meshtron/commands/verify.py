"""`meshtron verify`: run a layout and the single-device reference on a shrunk copy of the model, before
a big job, and say whether they compute the same thing.

The model keeps its architecture and every option (heads and key/value heads, so tensor and context
parallel cut it the same way; experts, top-k, router and balancing options; tied embeddings, norms,
biases, windows) and is narrowed: head_dim 8, dim = n_heads·8, FFN widths 2·dim (experts' dim), a
512-entry vocabulary on the default corpus with the byte tokenizer, the fewest layers the pipeline
split allows, short sequences and one sequence per micro-batch per data-parallel rank. Both runs take
`steps` steps in fp32 from the same seed and data; the report prints each step's loss difference, the
worst step-1 gradient difference per parameter group, and each group's counted communication of
step 2 next to its formula (docs/theory.md#communication-volume). The exit status is non-zero when a
loss or gradient differs by more than the tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import tempfile
from typing import Any

import torch

from meshtron.comm.workers import WorkerPool, close_pools
from meshtron.config.schema import Config
from meshtron.plan.comm import exact_groups, step_bytes
from meshtron.probe.cluster import run_exchange
from meshtron.rules.checks import check
from meshtron.testing.parity import run_layout

HEAD_DIM = 8
GROUPS = (
    ("embedding and head", r"tok_embeddings|output"),
    ("experts", r"moe\.experts\."),
    ("router", r"moe\.(router|shared_gate)"),
    ("attention", r"attention\.(wq|wk|wv|wo)"),
    ("feed-forward", r"feed_forward|shared_experts"),
    ("norms", r"norm"),
)


def shrink(cfg: Config, world: int) -> Config:
    """A copy of `cfg` small enough for this machine, with the same architecture and layout."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    dim = m.n_heads * HEAD_DIM
    width = 2 * dim * max(p.tp, 1)
    chunks = p.pp * p.vpp
    model = dataclasses.replace(
        m,
        name="",
        init_from="",
        dim=dim,
        head_dim=HEAD_DIM,
        ffn_dim=width,
        vocab_size=512,
        n_layers=max(chunks, 2) if m.n_layers >= max(chunks, 2) else m.n_layers,
        moe_ffn_dim=width if m.is_moe else 0,
        shared_ffn_dim=width if m.n_shared_experts else 0,
        dense_layers=[i for i in m.dense_layers if i < max(chunks, 2)],
        rope_original_max_position=min(m.rope_original_max_position, 256),
    )
    dp = p.dp_replicate * (p.dp_shard if p.dp_shard > 0 else world // (p.pp * p.dp_replicate * p.cp * p.tp))
    micro_batches = max(chunks, 2)
    seq_len = 16 * p.cp * p.tp
    training = dataclasses.replace(
        t,
        steps=5,
        micro_batch=1,
        global_batch=dp * micro_batches,
        seq_len=seq_len,
        dtype="fp32",
        warmup_steps=1,
        lr=3e-3,
        eval_every=0,
    )
    parallel = dataclasses.replace(p, pp_layers=[])
    # The default corpus in bytes, in place of the run's data (a mixture, validation data of its tokenizer):
    # the steps compared do not evaluate.
    data = dataclasses.replace(
        cfg.data, path="default", sources=[], val_path="", val_fraction=0.0, tokenizer="byte"
    )
    checkpoint = dataclasses.replace(cfg.checkpoint, every=0, resume=False)
    # A check, not a run to keep: no plots, and nothing logged to the job's W&B project.
    run = dataclasses.replace(
        cfg.run, plot=False, dir=tempfile.mkdtemp(prefix="meshtron-verify-"), wandb_project=""
    )
    return dataclasses.replace(
        cfg, model=model, training=training, parallel=parallel, data=data, checkpoint=checkpoint, run=run
    )


def to_overrides(cfg: Config) -> list[str]:
    """`--section.key=value` for every field of `cfg` (what the worker processes rebuild it from)."""
    out = []
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            text = str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')
            out.append(f"--{section.name}.{f.name}={text}")
    return out


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def worst_gradients(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, tuple[float, str]]:
    """Per parameter group: the largest relative L2 difference of a parameter's gradient, and which."""
    worst: dict[str, tuple[float, str]] = {}
    for name, ref in want.items():
        err = float((got[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        group = group_of(name)
        if err >= worst.get(group, (-1.0, ""))[0]:
            worst[group] = (err, name)
    return worst


def report(result: dict[str, Any], ref: dict[str, Any], tolerance: float) -> tuple[list[str], bool]:
    """The printed lines, and whether everything is within `tolerance`."""
    lines, ok = ["step   loss (layout)   loss (1 device)   relative difference"], True
    for got, want in zip(result["rows"], ref["rows"], strict=True):
        diff = abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-30)
        ok &= diff <= tolerance
        lines.append(f"{got['step']:>4}   {got['loss']:>13.6f}   {want['loss']:>15.6f}   {diff:>19.2e}")
    lines.append("worst step-1 gradient difference (relative L2) per parameter group:")
    for group, (err, name) in sorted(worst_gradients(result["grads"], ref["grads"]).items()):
        ok &= err <= tolerance
        lines.append(f"  {group:<20} {err:.2e}  ({name})")
    return lines, ok


def quiet_run_layout(overrides: list[str], steps: int) -> dict[str, Any]:
    """`run_layout` without the trainer's console lines (which torch and backend it runs and what it
    builds): verify prints its own report."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run_layout(overrides, steps)


def verify(cfg: Config, nproc: int, steps: int = 5, tolerance: float = 1e-5, pools: Any = None) -> int:
    """Run the shrunk layout on `nproc` local ranks and on one; print the report; 0 when they agree.
    `pools(n)`: worker pools to run on (started here, and closed after, when not given)."""
    small = shrink(cfg, nproc)
    small = dataclasses.replace(small, training=dataclasses.replace(small.training, steps=steps))
    small = run_exchange(small, nproc)  # what the run takes, so the formula prices what it sends
    check(small, nproc)
    layout = to_overrides(small)
    single = dataclasses.replace(small, parallel=type(small.parallel)())
    print(f"meshtron verify: {nproc} ranks vs 1, shrunk model: {shape_of(small)}; {steps} steps, fp32")
    own = {} if pools is None else None
    if own is not None:
        own.update({nproc: WorkerPool(nproc, timeout_s=600), 1: WorkerPool(1, timeout_s=600)})
        pools = own.get
    try:
        results = pools(nproc).run(quiet_run_layout, layout, steps)
        ref = pools(1).run(quiet_run_layout, to_overrides(single), steps)[0]
    finally:
        if own is not None:
            close_pools(list(own.values()))
    result = {**results[-1], "grads": {k: v for r in results for k, v in r["grads"].items()}}
    lines, ok = report(result, ref, tolerance)
    comm: list[str] = []
    pp = small.parallel.pp
    for stage in sorted({0, pp - 1}):  # the first stage's first rank, and the last's (the head, MoE layers)
        rank = stage * nproc // pp  # (pp is the mesh's outermost dim)
        row = results[rank]["rows"][min(1, steps - 1)]
        lines_of, off = communication_lines(row, step_bytes(small, nproc, stage), exact_groups(small), rank)
        comm += lines_of
        ok &= not off
    print("\n".join(lines + comm))
    print(f"meshtron verify: {'OK' if ok else 'MISMATCH'} (tolerance {tolerance:g})")
    return 0 if ok else 1


def shape_of(cfg: Config) -> str:
    m, t = cfg.model, cfg.training
    experts = f", {m.n_experts} experts top-{m.top_k}" if m.is_moe else ""
    return (
        f"dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads / {m.kv_heads} kv{experts}; "
        f"batch {t.global_batch} x {t.seq_len} tokens, micro-batch {t.micro_batch}"
    )


def communication_lines(
    row: dict[str, Any], formulas: dict[str, float], exact: frozenset[str], rank: int = 0
) -> tuple[list[str], list[str]]:
    """`rank`'s counted bytes per group in one step, next to the formulas (plan/comm.py); and the groups
    of `exact` formulas whose count differs: a bug in the formula or in the counting, not noise."""
    lines = [
        f"communication of step {row['step']} on rank {rank} per group (bytes as comm/counted.py counts them; formula: "
        "plan/comm.py, exact where marked =, leading terms for tp and ep at balanced routing):",
        f"  {'group':<14} {'counted':>14} {'formula':>14}  counted/formula",
    ]
    off = []
    for group in sorted(set(row["comm_bytes_by_group"]) | set(formulas)):
        counted, formula = row["comm_bytes_by_group"].get(group, 0.0), formulas.get(group)
        ratio = f"{counted / formula:.3f}" if formula else "-"
        mark = ""
        if group in exact:  # float sums of integer byte counts: equal to rounding
            equal = abs(counted - (formula or 0.0)) <= 1e-9 * max(counted, formula or 0.0, 1.0)
            mark = " =" if equal else "  MISMATCH: the formula is exact for this group"
            off += [] if equal else [group]
        lines.append(f"  {group:<14} {counted:>14,.0f} {formula or 0:>14,.0f}  {ratio}{mark}")
    return lines, off
