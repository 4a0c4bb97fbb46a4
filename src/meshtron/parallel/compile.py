"""Compiled blocks (`training.compile = true`): each transformer block's forward through `torch.compile`,
as torchtitan compiles, after every other step of `parallelize` has shaped the block.

  choice                     why
  per block, not the model   the blocks are identical code, and their parameters are graph inputs
                             (inlined nn.Modules), so one compiled graph serves every block: compile time
                             does not grow with depth, and a pipeline stage compiles only what it holds
  the block's forward        module hooks stay outside the compiled function: ZeRO-3's gathers and
                             reduce-scatters, the pipeline's chunking run as in eager
  after tp/cp/ep, before     tp / sp / cp / ep have swapped the layers inside the block before the
  recompute                  compiler sees it; recompute's checkpoint then wraps the compiled forward
                             (full: the rerun calls the compiled code) or stays a graph break inside it
                             (selective: the attention core runs eagerly, checkpointed)
  collectives inside         comm/collectives.py's differentiable collectives and counted.py's
                             synchronous ones (tp's all-reduces and gathers, Ulysses' and ep's
                             all-to-alls) run eagerly, one graph break each (comm/counted.py `eager`:
                             traced into, their accounting broke the graph line by line and made
                             dynamo compile every fragment); the math between compiles; numerics
                             equal eager's (tests compare losses to 1e-5 in fp32)

  SimpleFSDP's gathers        under `parallel.fsdp_impl = "simple"` a parameter read inside a compiled
                             block goes through functional collectives (comm.gather_rows_traced), so the
                             gathers and reduce-scatters are in the graph, and inductor's passes bucket
                             them (one all-gather for many parameters) and reorder them against compute

What is not compiled: the embedding, the final norm, the head and the loss (outside the blocks).
"""

from __future__ import annotations

import torch

from meshtron.models.llama import Transformer

# Inductor's passes over the collectives in a graph: merge neighbouring all-gathers and reduce-scatters
# into one each, and move collectives to overlap compute. They are configuration of the private
# torch._inductor; a name this torch lacks is left out.
COLLECTIVE_PASSES = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}


def collective_passes() -> dict[str, object]:
    """The passes of COLLECTIVE_PASSES this torch's inductor has."""
    import torch._inductor.config as inductor_config

    return {name: v for name, v in COLLECTIVE_PASSES.items() if hasattr(inductor_config, name)}


def compile_blocks(model: Transformer, backend: str = "inductor", bucket_collectives: bool = False) -> None:
    """Replace each block's forward by its compiled version, in place (names and state dicts unchanged);
    `bucket_collectives`: with inductor's collective bucketing and reordering passes on."""
    options = collective_passes() if bucket_collectives and backend == "inductor" else None
    for _, block in model.blocks():
        block.forward = torch.compile(block.forward, backend=backend, options=options)
