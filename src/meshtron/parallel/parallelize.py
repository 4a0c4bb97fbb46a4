"""The composition: each parallelism applied to a built model as one visible step, in a fixed order.

  1  pipeline split      keep this rank's chunks of layers, so the steps below cut only what is kept
                         (pipeline/runtime.py)
  2  tensor (+ seq.)     column / row / vocab-parallel weights over tp (tensor.py)
     float8              with training.dtype = "fp8", the projections of each block as float8 layers
                         on this rank's shards (float8.py)
  3  context             attention exchanges K/V (or heads) over cp; each rank holds its tokens
                         (context.py)
  4  expert              each rank keeps its experts; tokens reach the others by all-to-all or
                         all-gather over ep (expert.py)
  5  compile             each block's forward through torch.compile, as the steps above left it
                         (`training.compile`; compile.py)
  6  recompute           what each block keeps for backward (recompute.py)
  7  data parallel       the engine that replicates or shards what is left (data_parallel.py); under
                         pp it runs per stage, over the chunks the pipeline runtime groups (which, with
                         `parallel.pp_overlap`, gives the comm layer its twin groups: pipeline/pairs.py)

A parallelism of degree 1 changes nothing (its step is skipped or does nothing), so the same code runs
one device and every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.mesh import ParallelMesh
from meshtron.comm.saved_gathers import SAVED_GATHERS
from meshtron.config.layout import PP_ENDS, Dim
from meshtron.config.schema import Config, ParallelConfig
from meshtron.engines.engine import DataParallelEngine
from meshtron.models.llama import Transformer
from meshtron.models.loss import cross_entropy_per_token
from meshtron.parallel.compile import compile_blocks
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.context_latent import apply_latent_exchange
from meshtron.parallel.data_parallel import DataParallelSettings, apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel, vocab_parallel_cross_entropy
from meshtron.pipeline.runtime import PipelineRuntime, split_pipeline


def apply_expert_step(model: Transformer, comm: Comm, mesh: ParallelMesh, cfg: Config) -> None:
    """Expert parallel with its groups: under etp = 1 the tp ranks each send their share of the tokens;
    the hierarchical dispatch takes the ep group cut by node."""
    p = cfg.parallel
    shares = mesh.group(Dim.TP) if not p.expert_tp and mesh.size(Dim.TP) > 1 else None
    hops = p.ep_dispatch == "hierarchical" and p.ep > 1
    # the node size set-up gave the comm (run.gpus_per_node, else the ranks per host); none: one node
    nodes = mesh.ep_node_groups(comm.ranks_per_node or mesh.dims.world_size) if hops else None
    apply_expert_parallel(model, comm, mesh.group(Dim.EP), p.ep_dispatch, shares, nodes)


@dataclass(frozen=True, kw_only=True)
class ParallelModel:
    """What `parallelize` made of a model on this rank (the training step's micro-batch loop over it is
    train/micro_batches.py)."""

    model: Transformer  # this rank's part of it (cut in place)
    engine: DataParallelEngine  # what the training loop drives: optimizer parameters, gradient sync
    tp_plan: TensorParallelPlan | None  # how tensor parallel cut each parameter (None without tp)
    pipeline: PipelineRuntime | None  # this rank's pipeline stage (None without pp)
    # Per-token cross-entropy [N] of this rank's logits (vocab-parallel under tp).
    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    comm: Comm
    # Under pp with tied embeddings, on the first and the last stage: the group that sums the copies' gradients.
    tied_ends: CommGroup | None = None
    # Under cp: the global positions [S/cp] of the tokens this rank holds of every sequence.
    positions: torch.Tensor | None = None
    # Parameters this rank holds whose gradient norm another rank counts (under pp: pipeline/runtime.py).
    counted_elsewhere: frozenset[str] = frozenset()


def parallelize(
    model: Transformer,
    comm: Comm,
    mesh: ParallelMesh,
    cfg: Config,
    layer_split: list[list[int]] | None = None,
    device: torch.device | None = None,
) -> ParallelModel:
    """Apply every parallelism of `cfg` to `model` (built whole, on this rank) in the order above.

    Args:
        model: the whole model, as every rank builds it.
        comm: the communication layer every step's collectives go through.
        mesh: this job's process groups, one per dim.
        cfg: the checked config (checks.check): nothing is validated again here.
        layer_split: with pp > 1, the layers of each of the pp·vpp chunks (plan.state.layer_split: the
            split the planner models).
        device: this rank's device, where what it holds lives (default: where the buffers are). The
            model may be built on the meta device (models/llama.py's `build_meta_model`): then only the
            parameters this rank holds get storage, uninitialised (regions.py fills them).
    """
    device = device or model.rope_inv_freq.device
    p = cfg.parallel
    if mesh.size(Dim.PP) > 1:
        if layer_split is None:
            raise ValueError("parallelize with pp > 1 needs the layer split (plan.state.layer_split(cfg))")
        split_pipeline(model, mesh.group(Dim.PP), layer_split, p.vpp, p.pp_schedule)
    else:
        layer_split = None
    tp_plan = None
    if mesh.size(Dim.TP) > 1:
        tp_plan = apply_tensor_parallel(model, comm, mesh.group(Dim.TP), p.sp, cfg.parallel.expert_tp)
    if cfg.training.dtype == "fp8":  # on this rank's shards, before compile and recompute wrap the blocks
        apply_float8(model, cfg.training.fp8_recipe, comm, mesh.group(Dim.TP))
    hybrid = 1 < mesh.dims.cp_ulysses < mesh.dims.cp
    ring, ulysses = (mesh.group(Dim.CP_RING), mesh.group(Dim.CP_ULYSSES)) if hybrid else (None, None)
    cp = mesh.group(Dim.CP)
    layout = apply_context_parallel(model, comm, cp, p.cp_impl, cfg.training.seq_len, ring, ulysses)
    if p.cp_exchange == "latent":  # MLA's latents travel instead of its keys and values
        apply_latent_exchange(model, comm, cp, p.cp_impl)
    apply_expert_step(model, comm, mesh, cfg)
    if cfg.training.compile:  # SimpleFSDP's gathers, traced inside the blocks, are bucketed too
        compile_blocks(model, bucket_collectives=p.zero == 3 and p.fsdp_impl == "simple")
    t = cfg.training
    keep = t.op_recompute_dispatch == "keep"
    apply_recompute(model, t.recompute, t.op_recompute_saves, keep_attention=p.cp == 1, keep_dispatch=keep)
    pipeline = _pipeline_runtime(model, comm, mesh, p, layer_split) if layer_split is not None else None
    roots = pipeline.boundary_chunks() if pipeline is not None else None
    chunks = list(pipeline.chunks.values()) if pipeline is not None else None
    engine = apply_data_parallel(model, comm, mesh, DataParallelSettings.of(cfg, device), roots, chunks)
    model.reset_buffers(device)  # built on the meta device, or emptied with fully_shard's shards
    if pipeline is not None and pipeline.holds_tied_weight():  # its gradient arrives in pieces
        engine.expect_grad_uses(model.tok_embeddings.weight, pipeline.embedding_grad_calls())
    token_loss = (
        cross_entropy_per_token
        if tp_plan is None
        else partial(vocab_parallel_cross_entropy, plan=tp_plan, comm=comm)
    )
    tied_ends = mesh.group(PP_ENDS) if pipeline is not None and pipeline.tied_across_ranks() else None
    return ParallelModel(
        model=model,
        engine=engine,
        tp_plan=tp_plan,
        pipeline=pipeline,
        token_loss=token_loss,
        comm=comm,
        tied_ends=tied_ends,
        positions=layout.positions(cp.rank) if layout is not None else None,
        counted_elsewhere=pipeline.counted_elsewhere() if pipeline is not None else frozenset(),
    )


def _pipeline_runtime(
    model: Transformer, comm: Comm, mesh: ParallelMesh, p: ParallelConfig, layer_split: list[list[int]]
) -> PipelineRuntime:
    """Group what the steps before it left of this rank's chunks into the pipeline's modules."""
    seq_shards = mesh.size(Dim.TP) if p.sp else 1
    overlap = p.pp_overlap  # pairs.py: only dualpipev on CPU ranks gets here with it (rules/pipeline.py)
    if overlap:
        comm.add_pair_lane(mesh.pair_lane())
    pipeline = PipelineRuntime(
        model, comm, mesh.group(Dim.PP), p.vpp, p.pp_schedule, layer_split, seq_shards, overlap
    )
    if seq_shards > 1:  # sp's gathered inputs gathered again in backward (tensor.py), chunk by chunk
        for chunk in pipeline.chunks.values():
            SAVED_GATHERS.hook(chunk)
    return pipeline
