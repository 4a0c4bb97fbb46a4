"""Context parallel against the single-device run (losses over 6 steps, step-1 gradients; tolerances in
parity.py) for every implementation at cp 2 and 4 and composed with every other dim, and its
communication volume and kept activations against the formulas, exactly."""

from __future__ import annotations

import re
import shutil

import pytest

from meshtron.config.schema import ConfigError
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import (
    assert_losses_match,
    assert_parity,
    comm_by_op,
    merged,
    reference,
    run_layout,
    train_rows,
)
from meshtron.testing.tiny import MOE, TINY

RING2 = ["--parallel.cp=2"]
CASES = {
    # name: (world, model overrides, parallel overrides)
    "ring2": (2, [], RING2),
    "ring4": (4, [], ["--parallel.cp=4"]),
    "allgather2": (2, [], ["--parallel.cp=2", "--parallel.cp_impl=allgather"]),
    "allgather4": (4, [], ["--parallel.cp=4", "--parallel.cp_impl=allgather"]),
    "alltoall2": (2, [], ["--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "alltoall4_kv_replicated": (4, [], ["--parallel.cp=4", "--parallel.cp_impl=alltoall"]),
    "hybrid2x2": (4, [], ["--parallel.cp=4", "--parallel.cp_impl=hybrid", "--parallel.cp_ulysses=2"]),
    "ring2_mqa": (2, ["--model.n_kv_heads=1"], RING2),
    "alltoall2_mqa": (2, ["--model.n_kv_heads=1"], ["--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "ring2_mha_qk_norm_bias": (
        2,
        ["--model.n_kv_heads=4", "--model.qk_norm=true", "--model.qkv_bias=true"],
        RING2,
    ),
    "ring2_tied": (2, ["--model.tie_embeddings=true", "--model.vocab_size=301"], RING2),
    "ring2_sliding_window": (2, ["--model.sliding_window=10"], RING2),
    "allgather4_sliding_window": (
        4,
        ["--model.sliding_window=7"],
        ["--parallel.cp=4", "--parallel.cp_impl=allgather"],
    ),
    "ring2_moe": (2, MOE, RING2),
    "alltoall2_moe": (2, MOE, ["--parallel.cp=2", "--parallel.cp_impl=alltoall"]),
    "ring2_selective_recompute": (2, [], [*RING2, "--training.recompute=selective"]),
    "ring2_full_recompute": (2, [], [*RING2, "--training.recompute=full"]),
    "ring2_x_zero3_dp2": (4, [], [*RING2, "--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "ring2_x_zero1_dp2": (
        4,
        [],
        [*RING2, "--parallel.dp_shard=2", "--parallel.zero=1", "--training.micro_batch=4"],
    ),
    "ring2_x_zero2_dp2": (
        4,
        [],
        [*RING2, "--parallel.dp_shard=2", "--parallel.zero=2", "--training.micro_batch=4"],
    ),
    "ring2_x_hsdp": (
        4,
        [],
        [*RING2, "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch=4"],
    ),
    "ring2_x_torch_fsdp": (2, [], [*RING2, "--parallel.fsdp_impl=torch"]),
    "ring2_x_tp2_sp": (4, [], [*RING2, "--parallel.tp=2", "--parallel.sp=true"]),
    "alltoall2_x_tp2": (4, [], ["--parallel.cp=2", "--parallel.cp_impl=alltoall", "--parallel.tp=2"]),
    "ring2_x_tp2_moe": (4, MOE, [*RING2, "--parallel.tp=2", "--parallel.sp=true"]),
    "pp2_x_ring2_1f1b": (4, [], [*RING2, "--parallel.pp=2", "--training.micro_batch=2"]),
    "pp2_x_ring2_gpipe": (
        4,
        [],
        [*RING2, "--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--training.micro_batch=2"],
    ),
    "pp2_x_allgather2_interleaved": (
        4,
        ["--model.n_layers=4"],
        [
            "--parallel.cp=2",
            "--parallel.cp_impl=allgather",
            "--parallel.pp=2",
            "--parallel.vpp=2",
            "--parallel.pp_schedule=interleaved",
            "--training.micro_batch=2",
        ],
    ),
    "pp2_x_alltoall2_zero_bubble_tied": (
        4,
        ["--model.tie_embeddings=true"],
        [
            "--parallel.cp=2",
            "--parallel.cp_impl=alltoall",
            "--parallel.pp=2",
            "--parallel.pp_schedule=zero_bubble",
            "--training.micro_batch=2",
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_device(workers, case):
    world, model, parallel = CASES[case]
    micro = [] if any("micro_batch" in p for p in parallel) else ["--training.micro_batch=8"]
    results = workers(world).run(run_layout, [*TINY, *model, *parallel, *micro])
    pipelined = any("parallel.pp=" in p for p in parallel)  # each stage its own parameters
    assert_parity(merged(results) if pipelined else results[0], reference(workers(1), model))
    for other in results[1:]:
        assert [r["loss"] for r in other["rows"]] == [r["loss"] for r in results[0]["rows"]]


def cp_comm(overrides: list[str]) -> dict[str, float]:
    """Bytes per collective on the cp group(s) of one forward + backward."""
    ops = ("send", "recv", "all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    return comm_by_op(overrides, ("cp", "cp_ring", "cp_ulysses"), ops)


@pytest.mark.parametrize("impl", ["ring", "allgather", "alltoall", "hybrid"])
def test_cp_moves_the_formula_volume(workers, impl):
    """docs/context-parallel.md#communication, per layer and micro-batch, b sequences of s tokens, k
    key/value width (n_kv·Dh), q query width, 4 bytes (fp32):
      ring       send (and receive) 2·b·s·k·(cp−1)/cp forward, again backward, plus the fp32 dK/dV
                 accumulators' cp hops of 2·b·(s/cp)·k
      allgather  all-gather 2·b·s·k·(cp−1)/cp forward and again backward, reduce-scatter the same
      alltoall   q, k, v, o forward and their gradients backward: 2·b·(s/cp)·(2q + 2k')·(cp−1)/cp
                 with k' the key/value width after replication to cp heads
    Nothing else crosses the cp group but the gradient reductions, which are the data-parallel ones."""
    world = 4
    extra = ["--parallel.cp_ulysses=2"] if impl == "hybrid" else []
    overrides = [*TINY, "--parallel.cp=4", f"--parallel.cp_impl={impl}", *extra, "--parallel.dp_shard=1"]
    overrides += ["--parallel.zero=1", "--training.micro_batch=8"]
    got = workers(world).run(cp_comm, overrides)[0]
    cfg = load_config(None, overrides)
    m, t = cfg.model, cfg.training
    b, s, layers, cp = t.micro_batch, t.seq_len, m.n_layers, 4
    k, q = m.kv_heads * m.head_size * 4, m.n_heads * m.head_size * 4  # bytes per token
    if impl == "ring":
        want = {"send": layers * (2 * 2 * b * s * k * (cp - 1) / cp + cp * 2 * b * (s // cp) * k)}
        want["recv"] = want["send"]
    elif impl == "allgather":
        gather = 2 * b * s * k * (cp - 1) / cp
        want = {"all_gather": layers * 2 * gather, "reduce_scatter": layers * gather}
    elif impl == "alltoall":
        k_rep = max(k, m.head_size * 4 * cp)  # 2 kv heads replicated to 4
        want = {"all_to_all": layers * 2 * b * (s // cp) * (2 * q + 2 * k_rep) * (cp - 1) / cp}
    else:  # 2 ring x 2 ulysses: all-to-all over 2 with kv heads split, then a ring of 2 over half the heads
        u, r = 2, 2
        want = {"all_to_all": layers * 2 * b * (s // cp) * (2 * q + 2 * k) * (u - 1) / u}
        share, k_local = s // r, k // u
        want["send"] = layers * (2 * 2 * b * share * k_local * (r - 1) + r * 2 * b * share * k_local)
        want["recv"] = want["send"]
    rest = {op: v for op, v in got.items() if op not in want}
    assert {op: got[op] for op in want} == pytest.approx(want, rel=1e-12, abs=0)
    assert rest == {op: 0 for op in rest}


def test_moe_routing_statistics_are_summed_over_cp(workers):
    """The only other traffic on the cp group: each MoE layer's one all-reduce of its 2E + 2 routing
    statistics (per-expert counts and probability sums, the z-loss sum, the token count), forward, and
    its gradient backward."""
    overrides = [
        *TINY,
        *MOE,
        *RING2,
        "--parallel.dp_shard=1",
        "--parallel.zero=1",
        "--training.micro_batch=8",
    ]
    got = workers(2).run(cp_comm, overrides)[0]
    m = load_config(None, overrides).model
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    assert got["all_reduce"] == moe_layers * 2 * 2 * (2 * m.n_experts + 2) * 4 * (2 - 1) / 2


def test_bf16_runs_match_the_single_device_bf16_run(workers, tmp_path):
    """Under bf16 autocast every implementation trains as the cp = 1 run does, to bf16's precision: with
    FSDP's bf16 parameters, and with ZeRO-1's fp32 ones (then q and k leave the rotary embedding in fp32
    while v is bf16)."""
    base = [*TINY, "--training.dtype=bf16", "--training.steps=3", "--training.micro_batch=8"]
    want = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'single'}"])[0]
    for impl, zero in [("ring", 3), ("ring", 1), ("allgather", 1), ("alltoall", 1), ("alltoall", 3)]:
        layout = ["--parallel.cp=2", f"--parallel.cp_impl={impl}", f"--parallel.zero={zero}"]
        layout.append(f"--run.dir={tmp_path / f'{impl}-{zero}'}")
        assert_losses_match(workers(2).run(train_rows, [*base, *layout])[0], want, rtol=1e-2)


def test_invalid_cp_layouts_are_refused_with_the_fix():
    odd_heads = ["--model.n_heads=12", "--model.n_kv_heads=3", "--model.head_dim=8"]
    for overrides, world, message in [
        (["--parallel.cp=4", "--training.seq_len=36"], 4, "must be divisible by 8 for cp=4"),
        (["--parallel.cp=4", "--training.seq_len=36"], 4, "use seq_len=32"),
        (["--parallel.cp=4", "--parallel.cp_impl=alltoall", "--training.seq_len=34"], 4, "use seq_len=32"),
        (["--parallel.cp=4", "--parallel.cp_impl=hybrid"], 4, "use cp_ulysses in [2]"),
        (["--parallel.cp=2", "--parallel.cp_ulysses=2"], 2, "only read by cp_impl='hybrid'"),
        (["--parallel.cp=8", "--parallel.cp_impl=alltoall"], 8, "use cp_impl='ring' or 'allgather'"),
        (
            ["--parallel.cp=4", "--parallel.cp_impl=alltoall", *odd_heads],
            4,
            "neither split over nor replicated",
        ),
        (
            ["--parallel.cp=4", "--parallel.cp_impl=alltoall", "--parallel.tp=2"],
            8,
            "the 2 query heads of a tp rank",
        ),
        (
            ["--parallel.cp=8", "--parallel.cp_impl=hybrid", "--parallel.cp_ulysses=4", "--parallel.tp=2"],
            16,
            "use cp_ulysses in [2] or cp_impl='ring'",
        ),
        (["--parallel.cp=2", "--parallel.tp=4", "--parallel.sp=true", "--training.seq_len=36"], 8, "tp*cp=8"),
        (["--parallel.cp=2", "--model.capacity_factor=1.5", *MOE], 2, "dropless"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check(load_config(None, [*TINY, *overrides]), world)
    # Ulysses needs no zigzag: a length that divides by cp is enough.
    check(
        load_config(None, [*TINY, "--parallel.cp=4", "--parallel.cp_impl=alltoall", "--training.seq_len=36"]),
        4,
    )


def test_checkpoint_written_under_cp_resumes_on_other_layouts(workers, tmp_path):
    """Save under ring cp 2 x tp 2 + sp (ZeRO-3 shards over the cp ranks, MoE included); resume on one
    device and under all-to-all cp 2 x ZeRO-1 dp 2: each continues as the uninterrupted run does."""
    base = [*TINY, *MOE, "--training.steps=6", "--training.micro_batch=2"]
    saving = ["--checkpoint.every=3", "--checkpoint.keep=1"]
    straight = workers(1).run(train_rows, [*base, f"--run.dir={tmp_path / 'straight'}"])[0]
    saved_by = [*RING2, "--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_shard=1"]
    first = [*base, *saving, *saved_by, "--training.steps=3", f"--run.dir={tmp_path / 'first'}"]
    assert [r["step"] for r in workers(4).run(train_rows, first)[0]] == [1, 2, 3]
    for name, world, layout in [
        ("single", 1, ["--parallel.dp_shard=1"]),
        ("alltoall2_zero1", 4, ["--parallel.cp=2", "--parallel.cp_impl=alltoall", "--parallel.zero=1"]),
    ]:
        shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / name / "checkpoints")
        resume = [*base, *saving, *layout, "--checkpoint.resume=true", f"--run.dir={tmp_path / name}"]
        rows = workers(world).run(train_rows, resume)[0]
        assert_losses_match(rows, straight[3:])
