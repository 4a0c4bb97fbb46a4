"""The tiny models every test and check shares: their config overrides, and weights that look trained."""

from __future__ import annotations

import math

import torch

from meshtron.config.schema import Config
from meshtron.rules.checks import load_config

# A 158K-parameter Llama (dim 64, 2 layers, 4 heads / 2 kv, byte vocabulary) on the default corpus, 10
# steps of 8 x 32 tokens: small enough that a parity case costs a second or two on one CPU core.
TINY = [
    "--model.name=tiny",
    "--data.tokenizer=byte",
    "--training.seq_len=32",
    "--training.global_batch=8",
    "--training.lr=3e-3",
    "--training.warmup_steps=2",
    "--training.steps=10",
    "--run.plot=false",
]
# One step of 4 x 32 tokens, one sequence per micro-batch: a checkpoint's first loss against another
# framework's (the model and the data come from the checkpoint).
ONE_STEP_SEQ, ONE_STEP_BATCH = 32, 4
ONE_STEP = [
    f"--training.seq_len={ONE_STEP_SEQ}",
    f"--training.global_batch={ONE_STEP_BATCH}",
    "--training.micro_batch=1",
    "--training.steps=1",
    "--run.plot=false",
]
# Its mixture-of-experts sibling with every routing option switched on: 4 experts, top 2, a gated
# shared expert and the router z-loss.
MOE = ["--model.name=tiny-moe", "--model.shared_expert_gate=true", "--model.z_loss_coef=0.001"]


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Weights on the scale of a trained model: unit-ish norms, non-zero biases, O(1) activations.

    Default inits (norms at one, biases at zero, std 0.02 matrices) would let a swapped norm or a
    dropped bias pass unnoticed, and keep router logits so small that routing would hardly matter.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("bias"):
            param.copy_(0.3 * noise)
        elif param.ndim == 1:  # RMSNorm weights
            param.copy_(1.0 + 0.3 * noise)
        elif "embed" in name:
            param.copy_(noise)
        else:  # every weight here is [..., out, in]: scale by fan-in
            param.copy_(noise / math.sqrt(param.shape[-1]))


# A Qwen2-MoE config for save_tiny_hf_model: 4 experts, top 2 unnormalised, a gated shared expert.
QWEN2_MOE_SHARED = (
    "Qwen2MoeConfig",
    dict(num_key_value_heads=2, moe_intermediate_size=20, shared_expert_intermediate_size=36, num_experts=4,
         num_experts_per_tok=2, norm_topk_prob=False),
)  # fmt: skip


def save_tiny_hf_model(config_name: str, extra: dict, path: str) -> torch.nn.Module:
    """A tiny transformers model (hidden 48, 4 heads, 2 layers, FFN 60, vocabulary 97; `extra` for its
    config class `config_name`) with weights that look trained (`perturb`), saved in `path` as a
    Hugging Face checkpoint; returned in fp32, in eval mode. Needs transformers (the dev extra)."""
    import transformers

    config = getattr(transformers, config_name)(
        hidden_size=48,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=60,
        vocab_size=97,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    perturb(model, 0)
    model.save_pretrained(path)
    return model


# The planner's tests work at the scale users run: a named model (e.g. LLAMA_1B) at seq 4096 in bf16.
LLAMA_1B = ["--model.name=llama3-1b"]


def planner_config(overrides: list[str], seq: int = 4096, batch: int = 64) -> Config:
    """The config of `overrides` at sequence length `seq`, global batch `batch`, bf16 (no layout yet)."""
    extra = [f"--training.seq_len={seq}", f"--training.global_batch={batch}", "--training.dtype=bf16"]
    return load_config(None, [*overrides, *extra])
