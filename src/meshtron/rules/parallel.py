"""What each parallelism needs of the model, the batch and its options, one section per parallelism
(parallel/tensor.py, context.py, expert.py and data_parallel.py run them). Torch-free, so that a config
is checked (and `meshtron plan` searches layouts) without importing torch; checks.py gathers every
subject's rules.
A `*_problems` function names a config that cannot work; a `*_unsupported` one, a valid layout this
version cannot run yet."""

from __future__ import annotations

import math

from meshtron.config.layout import divisors, ep_folding_problem, world_size_problems
from meshtron.config.schema import SPLIT_BACKWARD, Config


def tp_choices(cfg: Config) -> list[int]:
    """The tp degrees every split below allows: divisors of the head count, the FFN widths tp cuts
    (shared experts', and routed experts' with etp = tp) and that divide or are divided by the KV heads."""
    m, p = cfg.model, cfg.parallel
    widths = [m.n_heads, m.ffn_dim]
    widths += [m.shared_expert_ffn_dim] if m.is_moe and m.n_shared_experts else []
    widths += [m.expert_ffn_dim] if m.is_moe and p.expert_tp else []
    return [t for t in divisors(math.gcd(*widths)) if m.kv_heads % t == 0 or t % m.kv_heads == 0]


def tensor_parallel_problems(cfg: Config) -> list[str]:
    """What splitting heads, FFN widths and the sequence over tp needs of the model and the batch; each
    fix offers the tp degrees that pass every one of these splits, not only its own."""
    m, p, tp = cfg.model, cfg.parallel, cfg.parallel.tp
    splits = []
    if m.n_heads % tp:
        splits.append(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}")
    elif m.kv_heads % tp and tp % m.kv_heads:
        splits.append(
            f"model.n_kv_heads={m.kv_heads} and parallel.tp={tp}: one must divide the other "
            "so key/value heads can be split or replicated"
        )
    if m.ffn_dim % tp:
        splits.append(f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}")
    if m.is_moe and m.n_shared_experts and m.shared_expert_ffn_dim % tp:
        splits.append(f"shared expert ffn dim {m.shared_expert_ffn_dim} is not divisible by parallel.tp={tp}")
    if m.is_moe and p.expert_tp and m.expert_ffn_dim % tp:
        splits.append(f"expert ffn dim {m.expert_ffn_dim} is not divisible by parallel.tp={tp}")
    problems = []
    if splits:  # (the search validates many layouts: the degrees are found only for a broken one)
        choices = tp_choices(cfg)
        fix = f"; use tp in {choices}" if len(choices) > 1 else "; no tp > 1 splits this model: use tp=1"
        problems = [split + fix for split in splits]
    if p.sp and tp == 1:
        problems.append(
            "parallel.sp=true needs parallel.tp > 1 (sequence parallel splits along the tp group)"
        )
    if p.sp and cfg.training.seq_len % (tp * p.cp):
        problems.append(
            f"training.seq_len={cfg.training.seq_len} must be divisible by tp*cp={tp * p.cp} with sp"
        )
    return problems


def sequence_divisor(cfg: Config) -> int:
    """What seq_len must divide by: 2·R chunks for a ring (or all-gather) of R ranks, and the cp pieces
    of the sequence (each ring rank's share is cut in cp_ulysses consecutive pieces)."""
    ring, _ = cfg.parallel.cp_split
    cp = cfg.parallel.cp
    return cp if ring == 1 else math.lcm(2 * ring, cp)


def _heads_problems(cfg: Config) -> list[str]:
    """Ulysses splits each tp rank's query heads over its ranks, and splits or replicates the KV heads."""
    p, m = cfg.parallel, cfg.model
    _, ulysses = cfg.parallel.cp_split
    heads, kv_heads = m.n_heads // p.tp, m.kv_heads_per_rank(p.tp)
    if ulysses == 1:
        return []
    fits = [u for u in divisors(p.cp) if 1 < u < p.cp and heads % u == 0]
    fix = (
        f"use cp_ulysses in {fits} or cp_impl='ring'"
        if p.cp_impl == "hybrid" and fits
        else "use cp_impl='ring'"
    )
    problems = []
    if heads % ulysses:
        problems.append(
            f"cp_impl={p.cp_impl!r} splits the {heads} query heads of a tp rank over {ulysses} ranks, which "
            f"needs model.n_heads divisible by tp*{ulysses}; {fix} or 'allgather'"
        )
    if kv_heads % ulysses and ulysses % kv_heads:
        problems.append(
            f"cp_impl={p.cp_impl!r}: the {kv_heads} key/value heads of a tp rank can be neither split over "
            f"nor replicated to {ulysses} ranks (one must divide the other); {fix}"
        )
    return problems


def context_parallel_problems(cfg: Config) -> list[str]:
    """What splitting the sequence over cp ranks needs of the batch, the model and cp_impl's options."""
    p, seq_len = cfg.parallel, cfg.training.seq_len
    problems = []
    if p.cp_impl != "hybrid" and p.cp_ulysses != 1:
        problems.append(f"parallel.cp_ulysses={p.cp_ulysses} is only read by cp_impl='hybrid'; set it to 1")
    if p.cp_impl == "hybrid" and (p.cp % p.cp_ulysses or not 1 < p.cp_ulysses < p.cp):
        choices = [d for d in divisors(p.cp) if 1 < d < p.cp]
        fix = (
            f"use cp_ulysses in {choices}" if choices else "hybrid needs a cp with a divisor between 1 and cp"
        )
        problems.append(f"cp_impl='hybrid' needs 1 < parallel.cp_ulysses < cp dividing cp={p.cp}; {fix}")
        return problems
    step = sequence_divisor(cfg)
    if p.cp > 1 and seq_len % step:
        why = "one piece per rank" if step == p.cp else "load balancing gives each ring rank two chunks"
        problems.append(
            f"training.seq_len={seq_len} must be divisible by {step} for cp={p.cp} with cp_impl={p.cp_impl!r} "
            f"({why}); use seq_len={seq_len - seq_len % step or step}"
        )
    problems += _heads_problems(cfg)
    if p.cp_exchange == "latent" and not (cfg.model.is_mla and p.cp_impl in ("ring", "allgather")):
        problems.append(
            f"parallel.cp_exchange='latent' sends multi-head latent attention's latents around a ring or "
            f"all-gather; this run has {'MLA' if cfg.model.is_mla else 'no MLA (model.kv_lora_rank=0)'} and "
            f"cp_impl={p.cp_impl!r}: use cp_exchange='kv' (or 'auto')"
        )
    if p.cp > 1 and cfg.model.is_moe and cfg.model.capacity_factor > 0:
        problems.append(
            "model.capacity_factor > 0 with parallel.cp > 1: which tokens overflow an expert's capacity "
            "depends on the tokens a rank sees; use a dropless MoE (capacity_factor=0) with cp"
        )
    return problems


def expert_parallel_problems(cfg: Config) -> list[str]:
    """What the experts' grid (config/layout.py: ep x etp x edp over each stage's dp_shard x cp x tp) needs
    of the model."""
    m, p = cfg.model, cfg.parallel
    problems = []
    if p.etp not in (0, 1, p.tp):
        problems.append(
            f"parallel.etp={p.etp} must be 1 (whole experts, ep may take tp ranks) or tp={p.tp} (experts "
            "split over tp like the dense FFN)"
        )
    if p.ep == 1 and (p.expert_tp or not m.is_moe):
        return problems
    if not m.is_moe:
        return [*problems, f"parallel.ep={p.ep} needs an MoE model (model.n_experts > 0); set parallel.ep=1"]
    if m.n_experts % p.ep:
        problems.append(
            f"model.n_experts={m.n_experts} is not divisible by parallel.ep={p.ep}; use ep in "
            f"{divisors(m.n_experts)}"
        )
    return problems


def expert_parallel_unsupported(cfg: Config) -> list[str]:
    p = cfg.parallel
    if p.experts_apart and p.zero == 3 and p.fsdp_impl == "torch":
        return [
            "PyTorch's fully_shard is not wired to shard expert parameters over their expert-data-parallel "
            "group; use parallel.fsdp_impl='meshtron' with parallel.ep > 1"
        ]
    return []


def uses_torch_fsdp(cfg: Config, world_size: int) -> bool:
    """Whether PyTorch's fully_shard shards the model (ZeRO-3 over dp_shard·cp > 1, fsdp_impl="torch")."""
    p = cfg.parallel
    return p.dp_shard_for(world_size) * p.cp > 1 and p.zero == 3 and p.fsdp_impl == "torch"


def data_parallel_unsupported(cfg: Config, world_size: int) -> list[str]:
    """The engine choices this version cannot run yet."""
    p = cfg.parallel
    if uses_torch_fsdp(cfg, world_size) and p.pp > 1:
        return [
            "PyTorch's fully_shard is not wired into the pipeline runtime; use parallel.fsdp_impl='meshtron' "
            "with parallel.pp > 1"
        ]
    if p.fsdp_impl == "torch" and p.zero != 3:  # it would be ignored: ZeRO-1/2 are meshtron's alone
        return [
            f"parallel.fsdp_impl='torch' is PyTorch's fully_shard, ZeRO-3 (parameters sharded); set "
            f"parallel.zero=3, not {p.zero}, or leave fsdp_impl at 'meshtron'"
        ]
    if p.fsdp_impl != "simple":
        return []
    problems = []
    if p.zero != 3:
        problems.append(
            f"parallel.fsdp_impl='simple' is ZeRO-3 (parameters sharded); set parallel.zero=3, not {p.zero}"
        )
    if p.experts_apart:
        problems.append(
            "parallel.fsdp_impl='simple' does not shard experts over their expert-parallel grid yet (ep > 1, or etp=1 "
            "under tp); use fsdp_impl='meshtron'"
        )
    if p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD:
        problems.append(
            f"parallel.fsdp_impl='simple' with pp_schedule={p.pp_schedule!r}: a split backward computes weight "
            "gradients outside the gather's autograd; use gpipe, 1f1b or interleaved, or fsdp_impl='meshtron'"
        )
    return problems


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """The layout's own rules: the dims multiply to the world size, and the experts' grid (ep x etp)
    folds into each stage's dp_shard x cp x tp."""
    p = cfg.parallel
    degrees = {"pp": p.pp, "dp_replicate": p.dp_replicate, "cp": p.cp, "tp": p.tp}
    problems = world_size_problems(degrees, p.dp_shard, world_size)
    # Only for MoE models: with a dense one, ep > 1 is refused by the expert-parallel rules already; an
    # etp outside (0, 1, tp) is the expert-parallel rules' to report.
    etp = p.tp if p.expert_tp else p.etp
    folding = None
    if cfg.model.is_moe and etp in (1, p.tp):
        folding = ep_folding_problem(p.dp_shard_for(world_size), p.cp, p.tp, p.ep, etp)
    problems += [folding] if folding else []
    if not problems and p.ep_dispatch == "hierarchical" and p.ep > 1 and cfg.run.gpus_per_node:
        try:
            p.dims(world_size).ep_node_groups(cfg.run.gpus_per_node)
        except ValueError as error:
            problems.append(
                f"parallel.ep_dispatch='hierarchical' with run.gpus_per_node={cfg.run.gpus_per_node}: {error}"
            )
    return problems
