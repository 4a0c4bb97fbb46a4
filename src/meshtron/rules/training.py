"""What the training loop's services need of the config: recompute that compiled blocks can honour, and
the Weights & Biases package when run.wandb_project asks for it. Torch-free (checks.py gathers every
package's rules)."""

from __future__ import annotations

import importlib.util
import sys

from meshtron.config.schema import Config
from meshtron.rules.parallel import uses_torch_fsdp


def _needs_own_engines(what: str) -> str:
    return (
        f"{what} needs meshtron's engines (PyTorch's fully_shard reduces across dp_replicate itself): "
        "use parallel.fsdp_impl='meshtron' or 'simple'"
    )


def diloco_problems(cfg: Config, world_size: int) -> list[str]:
    """What DiLoCo (fault_tolerance.diloco_every > 0, train/diloco.py) needs of the layout."""
    p, h = cfg.parallel, cfg.fault_tolerance.diloco_every
    if not h:
        return []
    problems = []
    if p.dp_replicate < 2:
        problems.append(
            f"fault_tolerance.diloco_every={h} trains the dp_replicate slices apart: it needs "
            "parallel.dp_replicate >= 2 (or set diloco_every=0)"
        )
    if uses_torch_fsdp(cfg, world_size):
        problems.append(_needs_own_engines("fault_tolerance.diloco_every > 0"))
    if cfg.data.sources:
        problems.append(
            "fault_tolerance.diloco_every > 0 with a data mixture (data.sources) is not supported yet (each replica's loss "
            "over its own samples per source): use one data source, or diloco_every=0"
        )
    return problems


def replica_group_problems(cfg: Config, world_size: int) -> list[str]:
    """What replica groups that fail and heal (fault_tolerance.enabled, train/fault_tolerance.py) need."""
    p, f = cfg.parallel, cfg.fault_tolerance
    if not f.enabled:
        return []
    problems = []
    if p.dp_replicate < 2:
        problems.append(
            "fault_tolerance.enabled makes each dp_replicate slice a replica group that fails and heals on "
            f"its own: it needs parallel.dp_replicate >= 2 (got {p.dp_replicate}); e.g. "
            "--parallel.dp_replicate=2, or fault_tolerance.enabled=false"
        )
    if f.diloco_every:
        problems.append(
            "fault_tolerance.enabled with diloco_every > 0 is not supported yet (a healing group would need "
            "DiLoCo's outer weights too): use one of them"
        )
    if uses_torch_fsdp(cfg, world_size):
        problems.append(_needs_own_engines("fault_tolerance.enabled"))
    if cfg.data.sources:
        problems.append(
            "fault_tolerance.enabled with a data mixture (data.sources) is not supported yet: use one data source"
        )
    if importlib.util.find_spec("torchft") is None:
        problems.append("fault_tolerance.enabled needs torchft: pip install torchft (or meshtron[ft])")
    return problems


def wandb_missing() -> bool:
    """Whether `import wandb` would fail; found without importing it (its import takes seconds)."""
    if "wandb" in sys.modules:  # imported already, or blocked (None), or stood in for by a test
        return sys.modules["wandb"] is None
    try:
        return importlib.util.find_spec("wandb") is None
    except (ImportError, ValueError):
        return True


def wandb_problems(cfg: Config) -> list[str]:
    """Config-time check: W&B logging asked for without the package."""
    if cfg.run.wandb_project and wandb_missing():
        return [
            f"run.wandb_project={cfg.run.wandb_project!r} needs the wandb package, which is not installed: "
            "pip install 'meshtron[wandb]' (or wandb), or leave run.wandb_project empty"
        ]
    return []


def mtp_problems(cfg: Config) -> list[str]:
    """Multi-token prediction's depth k predicts the token k + 1 places on: some must be in the sequence."""
    depth, seq_len = cfg.model.mtp_depth, cfg.training.seq_len
    if depth >= seq_len:
        return [
            f"model.mtp_depth={depth} leaves its last depth no target in sequences of training.seq_len="
            f"{seq_len}; use mtp_depth < seq_len (DeepSeek-V3: 1)"
        ]
    return []


def recompute_problems(cfg: Config) -> list[str]:
    """Per-operation recompute keeps outputs through a dispatch mode, which compiled blocks bypass; the
    policy that recomputes MLA's up-projections needs a model that has them."""
    t, problems = cfg.training, []
    if t.recompute == "op" and t.compile:
        problems.append(
            "training.recompute='op' keeps chosen operations' outputs as they run, which compiled blocks do "
            "not show it: with training.compile=true it would recompute whole blocks; use "
            "training.recompute='full' or 'selective' with compile, or training.compile=false"
        )
    if t.op_recompute_saves == "matmuls_but_mla_up" and not cfg.model.is_mla:
        problems.append(
            "training.op_recompute_saves='matmuls_but_mla_up' recomputes the up-projections of multi-head "
            "latent attention, which this model does not have (model.kv_lora_rank = 0); use 'matmuls'"
        )
    return problems


def float8_problems(cfg: Config, device_type: str | None) -> list[str]:
    """What training.fp8_all_gather needs; and on CUDA, float8 matmuls (the scaled-matmul kernel) take sizes that are multiples of 16: every float8
    projection's widths on a tp rank and the tokens of a micro-batch on a cp rank."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    if t.fp8_all_gather and (
        t.dtype != "fp8" or t.fp8_recipe != "tensorwise" or p.zero != 3 or p.fsdp_impl != "meshtron"
    ):
        return [
            "training.fp8_all_gather=true gathers the float8 layers' weights with one scale each: it needs "
            "training.dtype='fp8' with fp8_recipe='tensorwise' and meshtron's ZeRO-3 (parallel.zero=3, "
            "parallel.fsdp_impl='meshtron'); or set it to false"
        ]
    if t.dtype != "fp8" or (device_type or cfg.run.device) != "cuda":
        return []
    widths = {
        "model.dim": m.dim,
        "the query width per tp rank": m.n_heads * m.head_size // p.tp,
        "the key/value width per tp rank": m.kv_heads_per_rank(p.tp) * m.head_size,
        "model.ffn_dim per tp rank": m.ffn_dim // p.tp,
        "the tokens of a micro-batch per cp rank": t.micro_batch * t.seq_len // p.cp,
    }
    if m.n_shared_experts:
        widths["the shared experts' width per tp rank"] = m.shared_expert_ffn_dim // p.tp
    odd = [f"{name} = {value}" for name, value in widths.items() if value % 16]
    if not odd:
        return []
    # Under model.init_from the checkpoint's sizes cannot change (config/init_from.py refuses other [model] keys).
    fixed = " where they are not the model's (model.init_from fixes those)" if m.init_from else ""
    return [
        f"training.dtype='fp8' on CUDA needs float8 matmul sizes that are multiples of 16, not {', '.join(odd)}: "
        f"change them{fixed}, or use training.dtype='bf16'"
    ]


def float8_device_problems(capability: tuple[int, int]) -> list[str]:
    """A GPU of CUDA compute `capability` without float8 tensor cores (before 8.9) cannot run fp8."""
    if capability >= (8, 9):
        return []
    return [
        "training.dtype='fp8' needs float8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
        f"Blackwell); this GPU has {capability[0]}.{capability[1]}: use training.dtype='bf16'"
    ]


def profile_problems(cfg: Config) -> list[str]:
    """profile.steps is [] or [first, last] with 1 <= first <= last <= training.steps."""
    steps, total = cfg.profile.steps, cfg.training.steps
    if not steps:
        return []
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= total:
        return [
            f"profile.steps={steps} must be [first, last] with 1 <= first <= last <= training.steps ({total}), "
            "e.g. profile.steps=[3, 4] (or meshtron train --profile-steps 3,4); [] profiles nothing"
        ]
    return []


def muon_unsupported(cfg: Config, world_size: int) -> list[str]:
    """Muon's layouts this version cannot run yet: its Newton-Schulz needs each matrix whole, and the
    DTensor shards of PyTorch's fully_shard are not gathered for it."""
    if cfg.training.optimizer == "muon" and uses_torch_fsdp(cfg, world_size):
        return [
            "training.optimizer='muon' with PyTorch's fully_shard is not implemented; use "
            "parallel.fsdp_impl='meshtron' or 'simple'"
        ]
    return []
