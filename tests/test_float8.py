"""Float8 training (`training.dtype = "fp8"`): the float8 linear layer's arithmetic against a plain
restatement and against torch's own scaled matmul; under tensor parallel, column- and row-parallel
shards with their amax reductions equal one device to fp32 rounding (both recipes, forward and
gradients); whole layouts track the single-device float8 run (bf16's 1e-2 over three steps, as every
bf16 layout test asks); what stays bf16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron.comm.collectives import Comm
from meshtron.config.layout import ParallelDims
from meshtron.models.float8 import E4M3, E5M2, Float8Linear, no_reduce, quantize, scaled_mm
from meshtron.parallel.float8 import _reducers, apply_float8
from meshtron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from meshtron.rules.checks import load_config, validate
from meshtron.rules.training import float8_device_problems
from meshtron.testing.parity import assert_losses_match, comm_by_op, mesh_for, train_rows
from meshtron.testing.tiny import MOE, TINY

NO_REDUCE = (no_reduce, no_reduce, no_reduce)


def restated(t: torch.Tensor, dtype: torch.dtype, axis: int | None) -> torch.Tensor:
    """The cast, written out: scale = amax / the format's max, round to the format, scale back."""
    amax = t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)
    scale = amax / torch.finfo(dtype).max
    return (t / scale).to(dtype).float() * scale


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_float8_linear_is_the_restated_arithmetic(rowwise):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen, requires_grad=True)
    w = torch.randn(48, 32, generator=gen, requires_grad=True)
    dy = torch.randn(6, 48, generator=gen)
    y = Float8Linear.apply(x, w, None, rowwise, NO_REDUCE)
    y.backward(dy)
    row = 1 if rowwise else None
    want_y = restated(x.detach(), E4M3, row) @ restated(w.detach(), E4M3, row).T
    col = 0 if rowwise else None
    want_dx = restated(dy, E5M2, row) @ restated(w.detach(), E4M3, col)
    want_dw = restated(dy, E5M2, col).T @ restated(x.detach(), E4M3, col)
    for got, want in ((y, want_y), (x.grad, want_dx), (w.grad, want_dw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and float8 is a real rounding: not the fp32 product
    assert (y - x.detach() @ w.detach().T).abs().max() > 1e-3


def test_the_emulated_matmul_is_torchs_scaled_mm():
    """On the CPU torch 2.13 runs `torch._scaled_mm` itself (slowly): the emulation gives its result."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(32, 16, generator=gen)
    aq, sa = quantize(a, E4M3, None, no_reduce)
    bq, sb = quantize(b.T.contiguous(), E4M3, None, no_reduce)
    ours = scaled_mm(aq, sa, bq.T, sb, torch.float32)
    theirs = torch._scaled_mm(aq, bq.T, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    # The same products, summed in fp32 in another order by some CPUs' kernels (oneDNN on an AMD EPYC:
    # 1.1e-6 off in one element of 256): 32 terms of magnitude ~1 round to within ~32 * 2**-24 = 2e-6.
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=4e-6)


def sharded_float8(rowwise: bool) -> dict[str, float]:
    """On each of 2 ranks: a column-parallel and a row-parallel float8 layer cut from one device's, their
    outputs and gradients gathered back, against the one-device float8 layer (fp32, no autocast)."""
    comm, mesh = Comm(timeout_s=60), mesh_for(ParallelDims(tp=2, dp_shard=1))
    tp, r = mesh.group("tp"), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=gen) * torch.linspace(0.1, 3, 32)  # uneven columns: splits matter
    w, dy = torch.randn(16, 32, generator=gen), torch.randn(8, 16, generator=gen)
    errors = {}
    for kind in ("column", "row"):
        whole_x, whole_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        Float8Linear.apply(whole_x, whole_w, None, rowwise, NO_REDUCE).backward(dy)
        if kind == "column":  # rows of W, columns of y
            layer = ColumnParallelLinear(32, 8, bias=False)
            part_x, part_w, part_dy = x.clone(), w[8 * r : 8 * r + 8].clone(), dy[:, 8 * r : 8 * r + 8]
        else:  # columns of x and of W; y is a partial sum, whole dy
            layer = RowParallelLinear(16, 16, None)
            part_x, part_w, part_dy = (
                x[:, 16 * r : 16 * r + 16].clone(),
                w[:, 16 * r : 16 * r + 16].clone(),
                dy,
            )
        part_x.requires_grad_()
        part_w.requires_grad_()
        y = Float8Linear.apply(part_x, part_w, None, rowwise, _reducers(layer, comm, tp))
        y.backward(part_dy)
        with torch.no_grad():
            whole_y = Float8Linear.apply(x, w, None, rowwise, NO_REDUCE)
        got_y = (
            comm.all_gather_tensor(y.detach(), tp, dim=1)
            if kind == "column"
            else comm.all_reduce_(y.detach(), tp)
        )
        got_w = comm.all_gather_tensor(part_w.grad, tp, dim=0 if kind == "column" else 1)
        got_x = (
            comm.all_reduce_(part_x.grad, tp)
            if kind == "column"
            else comm.all_gather_tensor(part_x.grad, tp, dim=1)
        )
        for name, got, want in (
            ("y", got_y, whole_y),
            ("dW", got_w, whole_w.grad),
            ("dx", got_x, whole_x.grad),
        ):
            errors[f"{kind} {name}"] = float((got - want).norm() / want.norm())
    return errors


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_tensor_parallel_shards_cast_as_one_device(workers, rowwise):
    """Every scale group that spans the split is reduced over tp first, so the shards' float8 values are
    one device's: outputs and both gradients equal it to fp32 rounding of the accumulations."""
    for errors in workers(2).run(sharded_float8, rowwise):
        assert max(errors.values()) <= 1e-6, errors


def test_which_layers_are_float8():
    cfg = load_config(None, [*TINY, *MOE, "--model.n_shared_experts=1"])
    from meshtron.models.llama import build_model

    model = build_model(cfg.model, seed=0)
    assert apply_float8(model, "tensorwise", Comm(), None) == cfg.model.n_layers * 7  # wq..wo, shared w1..w3
    block = model.layers["0"]
    assert "forward" in vars(block.attention.wq) and "forward" in vars(block.moe.shared_experts.w2)
    assert "forward" not in vars(block.moe.router) and "forward" not in vars(model.output)


FP8 = [*TINY, "--training.dtype=fp8", "--training.steps=3"]
LAYOUTS = {
    "tp2_sp_rowwise": (2, ["--parallel.tp=2", "--parallel.sp=true", "--training.fp8_recipe=rowwise"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "zero3_dp2": (2, ["--parallel.dp_shard=2", "--training.micro_batch=4"]),
    "pp2_zero_bubble": (2, ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--training.micro_batch=2"]),
    "cp2_ring_op_recompute": (2, ["--parallel.cp=2", "--training.recompute=op"]),
    "ep2_moe": (2, [*MOE, "--parallel.ep=2", "--training.micro_batch=4"]),
    "ep2_over_tp2_sp_moe": (4, [*MOE, "--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=2",
                                "--parallel.etp=1", "--training.micro_batch=4"]),
    "compiled": (1, ["--training.compile=true"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layouts_track_the_single_device_float8_run(workers, tmp_path, case):
    world, extra = LAYOUTS[case]
    model = [o for o in extra if o.startswith(("--model.", "--training.fp8_recipe"))]
    want = workers(1).run(
        train_rows, [*FP8, *model, "--training.micro_batch=8", f"--run.dir={tmp_path / 'one'}"]
    )[0]
    micro = [] if any("micro_batch" in o for o in extra) else ["--training.micro_batch=8"]
    rows = workers(world).run(train_rows, [*FP8, *extra, *micro, f"--run.dir={tmp_path / case}"])[0]
    assert_losses_match(rows, want, rtol=1e-2)


def test_float8_sizes_are_checked_for_cuda():
    """torch._scaled_mm takes multiples of 16: on CUDA an odd width is refused before anything starts."""
    cfg = load_config(None, [*TINY, "--training.dtype=fp8", "--model.ffn_dim=100"])
    problems = validate(cfg, 1, "cuda")
    assert any("model.ffn_dim per tp rank = 100" in p for p in problems), problems
    assert not any("fp8" in p for p in validate(cfg, 1, "cpu"))


def gathered_bytes(overrides: list[str]) -> float:
    """The ZeRO-3 all-gather bytes of one step's forward and backward on this rank."""
    base = [*FP8, "--parallel.dp_shard=2", "--training.micro_batch=4", *overrides]
    return comm_by_op(base, ("dp_shard", "dp_shard_cp"), ("all_gather",))["all_gather"]


def test_zero3_gathers_float8_weights_in_float8(workers, tmp_path):
    """training.fp8_all_gather: the float8 layers' weights travel as e4m3 bytes, exactly 1 byte per
    element instead of bf16's 2 (their section padded to 16 bytes per rank), and the run tracks the
    bf16-gathered float8 run."""
    plain, f8 = (
        workers(2).run(gathered_bytes, extra)[0] for extra in ([], ["--training.fp8_all_gather=true"])
    )
    m = load_config(None, TINY).model
    q, kv = m.n_heads * m.head_size, m.kv_heads * m.head_size
    elements = (m.dim * (2 * q + 2 * kv) + 3 * m.dim * m.ffn_dim) // 2  # a rank's float8 rows per block
    e4m3_bytes = -(-elements // 16) * 16
    # per gather of a block on 2 ranks: out bytes fall by 2 * (2 * elements - e4m3_bytes), ring volume
    # counts half of that; forward and backward each gather every block once
    assert plain - f8 == 2 * m.n_layers * (2 * elements - e4m3_bytes), (plain, f8)
    base = [*FP8, "--parallel.dp_shard=2", "--training.micro_batch=4"]
    want = workers(2).run(train_rows, [*base, f"--run.dir={tmp_path / 'a'}"])[0]
    rows = workers(2).run(
        train_rows, [*base, "--training.fp8_all_gather=true", f"--run.dir={tmp_path / 'b'}"]
    )[0]
    assert_losses_match(rows, want, rtol=1e-2)


def test_float8_all_gather_needs_tensorwise_zero3():
    cfg = load_config(
        None,
        [*TINY, "--training.dtype=fp8", "--training.fp8_all_gather=true", "--training.fp8_recipe=rowwise"],
    )
    assert any("fp8_all_gather" in p for p in validate(cfg, 2))


def test_gpus_without_float8_tensor_cores_are_refused():
    assert float8_device_problems((9, 0)) == [] and float8_device_problems((8, 9)) == []
    assert "this GPU has 8.0" in float8_device_problems((8, 0))[0]  # an A100
