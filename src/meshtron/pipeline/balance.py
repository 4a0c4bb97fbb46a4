"""The layers of every pipeline chunk for a config: split.py's even counts (optionally weighing the
embedding and the head as layers), the counts the config gives, or, with `parallel.pp_balance = "cost"`,
the split whose busiest rank is least busy by predicted training FLOPs per token (a rank's one chunk,
or under a V schedule its two: split.split_by_cost_v):

  transformer layer   attention projections + attention core (causal, at training.seq_len) + FFN,
                      or for an MoE layer its router and the experts a token visits (top-k + shared)
  embedding (chunk 0) 3·dim: a row read forward, a row added backward (memory-bound; counted so a
                      chunk is not empty of work)
  head + loss (last)  3·2·dim·vocab for the head, 3·3·vocab for the softmax cross-entropy

Imbalance left by whole layers shows as a bubble; `meshtron schedule` and the run's measured timeline
show it (docs/pipeline.md#balanced-splits).
"""

from __future__ import annotations

from meshtron.config import Config, ModelConfig
from meshtron.pipeline.schedules import V_SCHEDULES
from meshtron.pipeline.split import split_by_cost, split_by_cost_v, split_layers
from meshtron.plan.flops import TRAINING_PASSES, head_flops, layer_flops


def layer_costs(m: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(training FLOPs per token of each layer, of the embedding, of the head and loss)."""
    layers = [TRAINING_PASSES * layer_flops(m, i, seq_len).total for i in range(m.n_layers)]
    embedding = TRAINING_PASSES * m.dim
    head = TRAINING_PASSES * (head_flops(m).total + 3 * m.vocab_size)
    return layers, embedding, head


def layer_split_of(cfg: Config) -> list[list[int]]:
    """Layer indices of each of the pp·vpp chunks, as the config asks."""
    p, m = cfg.parallel, cfg.model
    chunks = p.pp * p.vpp
    if p.pp_balance != "cost" or p.pp_layers:
        return split_layers(m.n_layers, chunks, p.pp_embedding_layers, p.pp_head_layers, p.pp_layers or None)
    layers, embedding, head = layer_costs(m, cfg.training.seq_len)
    if p.pp_schedule in V_SCHEDULES:
        counts = split_by_cost_v(layers, p.pp, embedding, head)
    else:  # one chunk per rank, or interleaved: the largest chunk (a rank's sum is not searched)
        counts = split_by_cost(layers, chunks, embedding, head)
    return split_layers(m.n_layers, chunks, explicit=counts)
