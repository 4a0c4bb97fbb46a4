"""Expert parallel: the experts of every MoE layer placed on ep ranks. Not implemented yet.

Expert parallelism borrows its ranks from dp_shard × cp: the mesh re-reads that block as [edp, ep]
(mesh.py checks that ep divides it), so expert weights are replicated over dp_replicate × edp. The rules
about the model are checked up front with the others; until the token dispatch lands, its step in
`parallelize` refuses ep > 1.
"""

from __future__ import annotations

from meshtron.comm import Comm, CommGroup
from meshtron.config import Config, divisors, refuse
from meshtron.models.llama import Transformer


def expert_parallel_problems(cfg: Config) -> list[str]:
    """What placing whole experts on ep ranks needs of the model."""
    m, ep = cfg.model, cfg.parallel.ep
    if ep == 1:
        return []
    if not m.is_moe:
        return [f"parallel.ep={ep} needs an MoE model (model.n_experts > 0); set parallel.ep=1"]
    if m.n_experts % ep:
        return [
            f"model.n_experts={m.n_experts} is not divisible by parallel.ep={ep}; "
            f"use ep in {divisors(m.n_experts)}"
        ]
    return []


def expert_parallel_unsupported(cfg: Config) -> list[str]:
    """ep > 1, until expert parallel is built."""
    if cfg.parallel.ep > 1:
        return [f"parallel.ep={cfg.parallel.ep}: expert parallel is not implemented yet; use parallel.ep=1"]
    return []


def apply_expert_parallel(model: Transformer, comm: Comm, ep: CommGroup, cfg: Config) -> None:
    """The expert-parallel step of `parallelize`: nothing to do with ep = 1; ep > 1 is refused."""
    refuse(expert_parallel_unsupported(cfg))
