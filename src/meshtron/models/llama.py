"""Llama-family decoder: RMSNorm, RoPE (models/rope.py), grouped-query attention (models/attention.py)
or multi-head latent attention (models/latent_attention.py), SwiGLU or MoE (models/moe.py).

Covers Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm), Mixtral and Qwen-MoE, and
DeepSeek-V3 (MLA, its routing, dense first layers, multi-token prediction: models/mtp.py). For decoding,
`forward` takes an optional `KVCache` (what the tokens already seen left behind); training never passes
one, so its path is unchanged. Shapes in names: B batch, S sequence, D model dim, H query heads, K
key/value heads, Dh head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.attention import Attention, LayerKV
from meshtron.models.init import init_weights
from meshtron.models.latent_attention import LatentAttention, LatentKV
from meshtron.models.layers import FeedForward, RMSNorm
from meshtron.models.moe import MoE
from meshtron.models.mtp import MTPModule
from meshtron.models.rope import rope_cos_sin, rope_factor, rope_inv_freq


class KVCache:
    """Every layer's decoding cache, preallocated for `max_len` tokens (prompt + new), so a step appends
    in place instead of concatenating the whole history again: keys and values per key/value head
    (LayerKV), or under MLA a latent and a rotary key per token (LatentKV)."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if cfg.is_mla:
            self.layers = {str(i): LatentKV(cfg, batch, max_len, device, dtype) for i in range(cfg.n_layers)}
            self.token_bytes = cfg.n_layers * LatentKV.bytes_per_token(cfg, dtype)
        else:
            shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
            self.layers = {str(i): LayerKV(shape, device, dtype) for i in range(cfg.n_layers)}
            self.token_bytes = cfg.n_layers * LayerKV.bytes_per_token(cfg, dtype)

    @property
    def length(self) -> int:
        """Tokens cached so far: the position the next token takes."""
        return next(iter(self.layers.values())).length if self.layers else 0


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.is_mla else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer_id):
            self.moe: MoE | None = MoE(cfg)
            self.feed_forward: FeedForward | None = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | LatentKV | None = None,
        docs_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, cache, docs_BS)
        if self.moe is None:
            return h + self.feed_forward(self.ffn_norm(h)), None
        moe_out, aux_loss = self.moe(self.ffn_norm(h))
        return h + moe_out, aux_loss


class Transformer(nn.Module):
    """Decoder-only language model. `forward(tokens)` returns logits [B, S, V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_factor = rope_factor(cfg)
        # Multi-token prediction (models/mtp.py): depth k's block counts as layer n_layers + k.
        self.mtp = None
        if cfg.mtp_depth:
            depths = {
                str(k): MTPModule(cfg, TransformerBlock(cfg, cfg.n_layers + k)) for k in range(cfg.mtp_depth)
            }
            self.mtp = nn.ModuleDict(depths)

    def blocks(self) -> Iterator[tuple[str, TransformerBlock]]:
        """Every transformer block this model (or pipeline stage) holds, with its parameters' prefix: the
        layers', then the MTP modules' (what each parallelism cuts or wraps block by block)."""
        for name, block in self.layers.items():
            yield f"layers.{name}", block
        for name, module in (self.mtp or {}).items():
            yield f"mtp.{name}.block", module.block

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        return_aux: bool = False,
        cache: KVCache | None = None,
        docs_BS: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """Logits [B, S, V]; with return_aux also the summed MoE auxiliary loss (0 for dense models).
        With a cache, the tokens follow those it holds (positions offset by its length) and join it.
        `docs_BS`: each token's document (models/documents.py): attention stays within documents.
        `mtp_tokens` [D, B, S] (models/mtp.py): the MTP depths run too, and the logits are a tuple (the
        main model's, then each depth's)."""
        if positions_BS is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + tokens_BS.shape[1], device=tokens_BS.device)
            positions_BS = positions.expand_as(tokens_BS)
        h = self.tok_embeddings(tokens_BS)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions_BS, h.dtype, self.rope_factor)
        aux_loss = torch.zeros((), device=h.device)
        for name, block in self.layers.items():
            # Blocks are called as the pipeline runtime and recompute wrappers expect when not decoding.
            if cache is not None:
                h, block_aux = block(h, cos, sin, cache.layers[name])
            else:
                h, block_aux = block(h, cos, sin) if docs_BS is None else block(h, cos, sin, None, docs_BS)
            if block_aux is not None:
                aux_loss = aux_loss + block_aux
        logits = output_logits(h, self.norm, self.output, self.tok_embeddings)
        if mtp_tokens is not None and self.mtp is not None:
            depths, mtp_aux = predict_ahead(self.mtp, h, mtp_tokens, self, (cos, sin, docs_BS))
            logits, aux_loss = (logits, *depths), aux_loss + mtp_aux
        return (logits, aux_loss) if return_aux else logits

    def reset_buffers(self, device: torch.device) -> None:
        """The buffers' initial values on `device` (after a build on the meta device)."""
        self.rope_inv_freq = rope_inv_freq(self.cfg).to(device)
        for _, block in self.blocks():
            if block.moe is not None:
                block.moe.reset_buffers(device)

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - self.tok_embeddings.weight.numel() if exclude_embedding else total


def output_logits(
    h_BSD: torch.Tensor, norm: nn.Module, output: nn.Module | None, tok_embeddings: nn.Module
) -> torch.Tensor:
    """Final norm, then the output head, or the embedding matrix when the two are tied."""
    return head_logits(norm(h_BSD), output, tok_embeddings)


def head_logits(
    normed_BSD: torch.Tensor, output: nn.Module | None, tok_embeddings: nn.Module
) -> torch.Tensor:
    """The output head, or the embedding matrix when the two are tied."""
    return F.linear(normed_BSD, tok_embeddings.weight) if output is None else output(normed_BSD)


def predict_ahead(
    mtp: nn.ModuleDict, h_BSD: torch.Tensor, mtp_tokens_DBS: torch.Tensor, heads: nn.Module, attend: tuple
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each MTP depth's logits and the depths' summed MoE aux loss (models/mtp.py), from the main model's
    last block output; `heads` holds the embedding and the output head (the model, or a pipeline's last
    chunk), `attend` is (cos, sin, document ids or None)."""
    depths, aux = [], torch.zeros((), device=h_BSD.device)
    for module, tokens_BS in zip(mtp.values(), mtp_tokens_DBS, strict=True):
        h_BSD, normed, block_aux = module(h_BSD, heads.tok_embeddings(tokens_BS), *attend)
        depths.append(head_logits(normed, heads.output, heads.tok_embeddings))
        if block_aux is not None:
            aux = aux + block_aux
    return depths, aux


def build_model(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> Transformer:
    """A single-device model with layout-independent initial weights (init.py)."""
    model = Transformer(cfg)
    init_weights(model, cfg, seed)
    return model.to(device)


def build_meta_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """The model's structure with its parameters on the meta device (shapes, no storage) and its buffers
    on `device`: what `parallelize` cuts before each rank materialises only the parameters it holds."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.reset_buffers(torch.device(device))
    return model
