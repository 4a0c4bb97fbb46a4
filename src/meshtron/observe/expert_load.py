"""Expert load per MoE layer: what each step's routing did, the balancing bias it moves, (its heat map: pictures/experts.py).

Every MoE layer counts, over a step's micro-batches, the assignments routed to and kept by each of its
experts (models/moe.py). Once per optimizer step the counts are summed over the global batch (every
data- and context-parallel rank; tensor-parallel ranks route the same tokens and are not summed) and

  - drive auxiliary-loss-free balancing: b_e += rate * sign(mean load - load_e), kept zero-mean
    (DeepSeek-V3), on every rank holding the layer, so the copies stay identical;
  - become the metrics row's `moe`: per layer, imbalance = max / mean tokens per expert, dropped =
    the fraction of assignments over capacity, and the loads; `moe_imbalance` (the worst layer) and
    `moe_dropped` (all layers) as scalars for the console and TensorBoard.

Under pipeline parallel each stage reports its own layers; rank 0 collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.models.moe import MoE


class ExpertLoads:
    """The MoE layers of this rank's part of the model, read once per optimizer step."""

    def __init__(self, model: nn.Module, comm: Comm, data: CommGroup, pp: CommGroup, is_moe: bool):
        self.is_moe = is_moe  # of the whole model: a pipeline stage may hold none of its MoE layers
        self.layers = {
            name.removesuffix(".moe"): module
            for name, module in model.named_modules()
            if isinstance(module, MoE)
        }
        self.comm, self.data, self.pp = comm, data, pp

    def reduced(self, across: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Collective over the data-parallel group: this step's loads of this rank's MoE layers over the
        global batch, [layers, 2 (routed, kept), experts] (None: no MoE layer here); `across` sums them
        over what the group does not span (replica groups under fault tolerance)."""
        if not self.is_moe or not self.layers:
            return None
        loads_L2E = torch.stack([moe.take_loads() for moe in self.layers.values()])
        self.comm.all_reduce_(loads_L2E, self.data)
        if across is not None:
            across(loads_L2E)
        return loads_L2E

    def after_step(self, loads_L2E: torch.Tensor | None, update_bias: bool = True) -> dict[str, Any]:
        """Collective over the pipeline group: the bias step on the step's `reduced()` loads (not after a
        skipped step), and the metrics (complete on rank 0 of each pipeline)."""
        if not self.is_moe:
            return {}
        per_layer = {}
        if loads_L2E is not None:
            for moe, loads_2E in zip(self.layers.values(), loads_L2E, strict=True):
                if moe.router.expert_bias is not None and update_bias:
                    moe.router.update_bias(loads_2E[0])
            host = loads_L2E.double().tolist()  # every layer's loads in one read of the device
            per_layer = {name: _layer_metrics(*loads) for name, loads in zip(self.layers, host, strict=True)}
        if self.pp.size > 1:
            per_layer = {
                k: v for part in self.comm.all_gather_object(per_layer, self.pp) for k, v in part.items()
            }
        if not per_layer:
            return {}
        routed = sum(sum(layer["load"]) for layer in per_layer.values())
        dropped = sum(layer["dropped"] * sum(layer["load"]) for layer in per_layer.values())
        return {
            "moe": per_layer,
            "moe_imbalance": max(layer["imbalance"] for layer in per_layer.values()),
            "moe_dropped": dropped / max(routed, 1),
        }


def _layer_metrics(routed: list[float], kept: list[float]) -> dict[str, Any]:
    """A layer's metrics from its assignments routed to and kept by each expert."""
    total = sum(routed)
    return {
        "imbalance": max(routed) / (total / len(routed)) if total else 1.0,
        "dropped": 1 - sum(kept) / total if total else 0.0,
        "load": [int(v) for v in routed],
    }
