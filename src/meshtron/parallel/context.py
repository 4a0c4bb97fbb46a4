"""Context parallel: each sequence split over the cp ranks inside attention. Not implemented yet.

The cp dim already has its place in the mesh ([pp, dp_replicate, dp_shard, cp, tp], next to tp on the
fastest links), and its rules about the model and the batch are checked up front with the others, so a
layout that names cp fails before any process starts. Until the implementation lands, its step in
`parallelize` refuses cp > 1.

  causal load balancing   the sequence is cut into 2·cp chunks and rank r keeps chunks r and 2·cp−1−r,
                          so seq_len must divide by 2·cp
  alltoall (Ulysses)      attention heads are exchanged for sequence, so tp·cp must divide the heads
"""

from __future__ import annotations

from meshtron.comm import Comm, CommGroup
from meshtron.config import Config, refuse
from meshtron.models.llama import Transformer


def context_parallel_problems(cfg: Config) -> list[str]:
    """What splitting the sequence over cp ranks needs of the batch and the model."""
    p, seq_len, n_heads = cfg.parallel, cfg.training.seq_len, cfg.model.n_heads
    problems = []
    if p.cp > 1 and seq_len % (2 * p.cp):
        problems.append(
            f"training.seq_len={seq_len} must be divisible by 2*cp={2 * p.cp} "
            "(load-balanced causal context parallel gives each rank two chunks)"
        )
    if p.cp > 1 and p.cp_impl == "alltoall" and n_heads % (p.tp * p.cp):
        problems.append(
            f"cp_impl=alltoall needs model.n_heads={n_heads} divisible by tp*cp={p.tp * p.cp}; use cp_impl=ring"
        )
    return problems


def context_parallel_unsupported(cfg: Config) -> list[str]:
    """cp > 1, until context parallel is built."""
    if cfg.parallel.cp > 1:
        return [f"parallel.cp={cfg.parallel.cp}: context parallel is not implemented yet; use parallel.cp=1"]
    return []


def apply_context_parallel(model: Transformer, comm: Comm, cp: CommGroup, cfg: Config) -> None:
    """The context-parallel step of `parallelize`: nothing to do with cp = 1; cp > 1 is refused."""
    refuse(context_parallel_unsupported(cfg))
