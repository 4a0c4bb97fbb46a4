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
  collectives inside         comm.py's autograd functions (tp's all-reduces, cp's exchanges, ep's
                             all-to-alls) are opaque to the compiler: it breaks the graph around them
                             and compiles the math between; numerics equal eager's (tests compare
                             losses to 1e-5 in fp32)

What is not compiled: the embedding, the final norm, the head and the loss (outside the blocks).
"""

from __future__ import annotations

import torch

from meshtron.models.llama import Transformer


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    """Replace each block's forward by its compiled version, in place (names and state dicts unchanged)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=backend)
