"""Decoding on one device with a KV cache: greedy, or sampled with a temperature and nucleus (top-p).

The prompt goes through the model once (filling the cache), then each new token alone, attending to
the cached keys and values; `Transformer.forward` offsets the rotary positions by what the cache holds.
MoE layers decode dropless, as Hugging Face inference does: a capacity over a one-token batch would
drop different tokens than the same capacity over the whole sequence, so cached and uncached decoding
would disagree, and neither would be the function the weights were exported as.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from meshtron.data.tokenizer import Tokenizer
from meshtron.models.llama import KVCache, Transformer
from meshtron.models.moe import MoE, loads_not_counted


@contextlib.contextmanager
def dropless(model: torch.nn.Module) -> Iterator[None]:
    """Every MoE layer without a capacity (and not counting loads) while decoding; restored after."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    factors = [m.capacity_factor for m in layers]
    try:
        for m in layers:
            m.capacity_factor = 0.0
        with loads_not_counted():
            yield
    finally:
        for m, factor in zip(layers, factors, strict=True):
            m.capacity_factor = factor


def next_token(
    logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """[B]: the argmax at temperature 0; otherwise a draw from softmax(logits / T) restricted to the
    smallest set of most likely tokens whose probability reaches top_p (always at least one)."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token stays if the probability of those before it has not reached top_p yet.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # multinomial on the CPU: the same seed gives the same tokens on any device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)


@torch.no_grad()
def generate(
    model: Transformer,
    tokens: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> torch.Tensor:
    """The new tokens [B, N] after `tokens` ([B, S] or one sequence [S], which gives [1, N]), N <=
    max_new_tokens: decoding stops once every sequence has produced `eos_id` (finished sequences are
    padded with it). temperature 0 is greedy; the seed fixes the draws otherwise."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    device = next(model.parameters()).device
    prompt = torch.as_tensor(tokens, dtype=torch.long, device=device)
    prompt = prompt[None] if prompt.ndim == 1 else prompt
    if prompt.shape[1] == 0:
        raise ValueError("generate needs a prompt of at least one token")
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.cfg, prompt.shape[0], prompt.shape[1] + max_new_tokens, device, dtype)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with dropless(model):
            logits = model(prompt, cache=cache)
            for _ in range(max_new_tokens):
                token = next_token(logits[:, -1], temperature, top_p, generator)
                if eos_id is not None:
                    token = token.masked_fill(done, eos_id)
                    done |= token == eos_id
                out.append(token)
                if bool(done.all()) or len(out) == max_new_tokens:
                    break
                logits = model(token[:, None], cache=cache)
    finally:
        model.train(was_training)
    return torch.stack(out, dim=1) if out else prompt.new_zeros((prompt.shape[0], 0))


def complete(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """The text the model writes after `prompt` (up to its end-of-document token, which is left out)."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    new = generate(model, ids, max_new_tokens, temperature, top_p, seed, tokenizer.eos_id)[0].tolist()
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    return tokenizer.decode(new)
