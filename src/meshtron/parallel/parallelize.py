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
from meshtron.comm.timing import TIMES
from meshtron.config.layout import PP_ENDS
from meshtron.config.schema import Config
from meshtron.engines.engine import DataParallelEngine
from meshtron.models.documents import DocumentMask, MicroBatchLayout
from meshtron.models.llama import Transformer
from meshtron.models.loss import MicroBatchLoss, cross_entropy_per_token
from meshtron.parallel.compile import compile_blocks
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.data_parallel import DataParallelSettings, apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel, vocab_parallel_cross_entropy
from meshtron.pipeline.runtime import PipelineRuntime, split_pipeline, sum_tied_gradients


@dataclass
class ParallelModel:
    """What `parallelize` made of a model on this rank."""

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
    # data.document_mask: attention within documents (set by the training job, which knows the end token).
    documents: DocumentMask | None = None

    def mask_documents(self, documents: DocumentMask | None) -> None:
        self.documents = documents

    def positions_of(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """Global positions [B, S/cp] of this rank's tokens under cp; None (0..S-1) without."""
        if self.positions is None:
            return None
        return self.positions.to(tokens_BS.device).expand(tokens_BS.shape[0], -1)

    def local_sequence(self, x_BS: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (or labels) of each sequence: all of them without cp."""
        if self.positions is None:
            return x_BS
        return x_BS[:, self.positions.to(x_BS.device)].contiguous()

    def layout_of(self, tokens_BS: torch.Tensor) -> MicroBatchLayout:
        """(RoPE positions [B, S/cp] of this rank's tokens or None for 0..S-1, document ids [B, S] or
        None) of a micro-batch, from its whole sequences: under cp the ids stay whole, since attention
        looks up those of the positions other ranks hold (context.py). Every rank and pipeline stage
        forms them from the tokens it holds, so nothing more travels."""
        if self.documents is None:
            return self.positions_of(tokens_BS), None
        window = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
        rope, docs = self.documents.layout(tokens_BS, window)
        return self.local_sequence(rope), docs

    def run_micro_batches(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        loss: MicroBatchLoss,
        device: torch.device,
        backward: bool = True,
        before_grads: Callable[[bool], None] = lambda is_last: None,
    ) -> torch.Tensor:
        """One step's micro-batches (whole sequences [B, S] of tokens and targets) through this rank's
        part of the model, the training step's and evaluation's loop: forwards (and with `backward` their
        backwards, `before_grads(is_last)` before each), in the pipeline schedule's order under pp, else
        one after another. Returns this rank's share of the summed cross-entropy (under pp, non-zero on
        the last stage only)."""
        layouts = [self.layout_of(x.to(device)) for x, _ in micro_batches]
        local = self.local_sequence  # under cp: this rank's tokens of each sequence
        micro_batches = [(local(x).to(device), local(y).to(device)) for x, y in micro_batches]
        if self.pipeline is not None:
            if not backward:
                return self.pipeline.forward_only(micro_batches, loss, layouts)
            return self.pipeline.run(micro_batches, loss, before_grads=before_grads, layouts=layouts)
        ce_sum = torch.zeros((), device=device)
        for index, ((inputs, targets), (rope, docs)) in enumerate(zip(micro_batches, layouts, strict=True)):
            if backward:
                before_grads(index == len(micro_batches) - 1)
            with TIMES.phase("forward", f"forward micro-batch {index}"):
                with loss.autocast():
                    logits, aux = self.model(inputs, rope, return_aux=True, docs_BS=docs)
                total, ce = loss.of(logits, aux, targets, index)
            del logits  # backward needs the loss's log-probabilities, not these: tokens x vocab freed now
            if backward:
                with TIMES.phase("backward", f"backward micro-batch {index}"):
                    total.backward()
            ce_sum += ce.detach()
        return ce_sum

    def finish_gradients(self) -> None:
        """After the step's last backward: wait for every gradient reduction, and sum the gradients of a
        tied embedding's two copies (so that they take the same optimizer step)."""
        self.engine.finish_gradients()
        if self.tied_ends is not None:
            sum_tied_gradients(self.engine, self.comm, self.tied_ends)

    def counted_elsewhere(self) -> frozenset[str]:
        """Parameters this rank holds whose gradient norm another rank counts."""
        return self.pipeline.counted_elsewhere() if self.pipeline is not None else frozenset()


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
    if mesh.size("pp") > 1:
        if layer_split is None:
            raise ValueError("parallelize with pp > 1 needs the layer split (plan.state.layer_split(cfg))")
        split_pipeline(model, mesh.group("pp"), layer_split, p.vpp, p.pp_schedule)
    else:
        layer_split = None
    tp_plan = None
    if mesh.size("tp") > 1:
        tp_plan = apply_tensor_parallel(model, comm, mesh.group("tp"), p.sp, cfg.parallel.expert_tp)
    if cfg.training.dtype == "fp8":  # on this rank's shards, before compile and recompute wrap the blocks
        apply_float8(model, cfg.training.fp8_recipe, comm, mesh.group("tp"))
    hybrid = 1 < mesh.dims.cp_ulysses < mesh.dims.cp
    ring, ulysses = (mesh.group("cp_ring"), mesh.group("cp_ulysses")) if hybrid else (None, None)
    seq_len = cfg.training.seq_len
    layout = apply_context_parallel(model, comm, mesh.group("cp"), p.cp_impl, seq_len, ring, ulysses)
    apply_expert_parallel(model, comm, mesh.group("ep"), p.ep_dispatch)
    if cfg.training.compile:  # SimpleFSDP's gathers, traced inside the blocks, are bucketed too
        compile_blocks(model, bucket_collectives=p.zero == 3 and p.fsdp_impl == "simple")
    t = cfg.training
    apply_recompute(model, t.recompute, t.op_recompute_saves, keep_attention=cfg.parallel.cp == 1)
    pipeline = None
    if layer_split is not None:  # group what the steps above left of this rank's chunks into modules
        seq_shards = mesh.size("tp") if p.sp else 1
        overlap = p.pp_overlap  # pairs.py: only dualpipev on CPU ranks gets here with it (rules/pipeline.py)
        if overlap:
            comm.add_pair_lane(mesh.pair_lane())
        pipeline = PipelineRuntime(
            model, comm, mesh.group("pp"), p.vpp, p.pp_schedule, layer_split, seq_shards, overlap
        )
        if seq_shards > 1:  # sp's gathered inputs gathered again in backward (tensor.py), chunk by chunk
            for chunk in pipeline.chunks.values():
                SAVED_GATHERS.hook(chunk)
    roots = pipeline.boundary_chunks() if pipeline is not None else None
    engine = apply_data_parallel(model, comm, mesh, DataParallelSettings.of(cfg, device), roots)
    model.reset_buffers(device)  # built on the meta device, or emptied with fully_shard's shards
    if pipeline is not None and pipeline.holds_tied_weight() and not pipeline.tied_across_ranks():
        engine.expect_grad_uses(model.tok_embeddings.weight, 2)  # a V's first rank: head and embedding
    token_loss = (
        cross_entropy_per_token
        if tp_plan is None
        else partial(vocab_parallel_cross_entropy, plan=tp_plan, comm=comm)
    )
    tied_ends = mesh.group(PP_ENDS) if pipeline is not None and pipeline.tied_across_ranks() else None
    positions = layout.positions(mesh.group("cp").rank) if layout is not None else None
    return ParallelModel(model, engine, tp_plan, pipeline, token_loss, comm, tied_ends, positions)
