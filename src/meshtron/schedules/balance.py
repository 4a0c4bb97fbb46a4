"""The layers of every pipeline chunk for a config: split.py's even counts (optionally weighing the
embedding and the head as layers), the counts the config gives, or, with `parallel.pp_balance = "cost"`,
the split whose busiest rank is least busy by predicted training FLOPs per token (a rank's one chunk,
or under a V schedule its two: split.split_by_cost_v), from the costs plan/flops.py's `layer_costs` gives:

  transformer layer   attention projections + attention core (causal, at training.seq_len) + FFN,
                      or for an MoE layer its router and the experts a token visits (top-k + shared)
  embedding (chunk 0) 3·dim: a row read forward, a row added backward (memory-bound; counted so a
                      chunk is not empty of work)
  head + loss (last)  3·2·dim·vocab for the head, 3·3·vocab for the softmax cross-entropy

Imbalance left by whole layers shows as a bubble; `meshtron schedule` and the run's measured timeline
show it (docs/pipeline.md#balanced-splits).
"""

from __future__ import annotations

from meshtron.config.schema import V_SCHEDULES, Config
from meshtron.schedules.split import split_by_cost, split_by_cost_v, split_layers

# Training FLOPs per token of (each transformer layer, the embedding, the head and loss): plan/flops.py's
# `layer_costs`, which the caller passes in (the planner models the pipeline, not the reverse).
LayerCosts = tuple[list[float], float, float]


def layer_split_of(cfg: Config, costs: LayerCosts | None = None) -> list[list[int]]:
    """Layer indices of each of the pp·vpp chunks, as the config asks (`costs`: needed with
    parallel.pp_balance = "cost")."""
    p, m = cfg.parallel, cfg.model
    chunks = p.pp * p.vpp
    if p.pp_balance != "cost" or p.pp_layers:
        return split_layers(m.n_layers, chunks, p.pp_embedding_layers, p.pp_head_layers, p.pp_layers or None)
    if costs is None:
        raise ValueError("parallel.pp_balance='cost' splits by layer costs: pass plan.flops.layer_costs")
    layers, embedding, head = costs
    if p.pp_schedule in V_SCHEDULES:
        counts = split_by_cost_v(layers, p.pp, embedding, head)
    else:  # one chunk per rank, or interleaved: the largest chunk (a rank's sum is not searched)
        counts = split_by_cost(layers, chunks, embedding, head)
    return split_layers(m.n_layers, chunks, explicit=counts)
