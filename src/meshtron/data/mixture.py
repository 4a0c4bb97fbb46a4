"""Data mixtures: several prepared datasets, each drawn by its weight, in one deterministic interleave.

`[[data.sources]]` names prepared datasets (one tokenizer for all) and their weights w (normalised to
sum to 1). The global batches are a stream of samples, each one window of `seq_len + 1` tokens of one
source:

  which source     sample i of the stream goes to the source furthest behind its share:
                   argmax_j (w_j·(i + 1) − n_j), n_j the samples source j has given so far (ties: the
                   first source), as Megatron's blended dataset builds its index; every source's count
                   stays within one sample of w_j·i at every point of the stream, so at every step
  which window     source j's n-th sample is window perm_j,e[n mod W_j] of that source (W_j windows,
                   e = n div W_j its epoch, the permutation drawn from (seed, j, e)): each source is
                   walked through in its own shuffled epochs, independently of the others
  which rank       step s takes stream samples [s·B, (s+1)·B); data-parallel rank r the r-th contiguous
                   slice, as with one dataset

Nothing depends on the layout. The sampler's state is the step and n_j, so a run resumes on any
layout exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshtron.data import IGNORE_INDEX, DataError
from meshtron.data.dataset import PreparedData
from meshtron.rules.data import batch_split_problem

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Mixture:
    """The sources of a mixture, opened, with their normalised weights."""

    sources: list[PreparedData]
    weights: np.ndarray

    @classmethod
    def open(cls, paths: list[str], weights: list[float]) -> Mixture:
        sources = [PreparedData.open(p) for p in paths]
        first = sources[0]
        for other in sources[1:]:
            same = (other.vocab_size, other.eos_id) == (first.vocab_size, first.eos_id) and _tokenizer_bytes(
                other
            ) == _tokenizer_bytes(first)
            if not same:
                raise DataError(
                    f"data.sources: {other.path} was prepared with another tokenizer than {first.path} "
                    f"(vocabulary {other.vocab_size} vs {first.vocab_size}); prepare every source with the "
                    "same --tokenizer"
                )
        w = np.asarray(weights, dtype=np.float64)
        return cls(sources, w / w.sum())

    # What the rest of a run asks of its data: the tokenizer's facts, the first source's files.
    vocab_size = property(lambda self: self.sources[0].vocab_size)
    eos_id = property(lambda self: self.sources[0].eos_id)
    n_tokens = property(lambda self: sum(s.n_tokens for s in self.sources))
    names = property(lambda self: [s.path.name for s in self.sources])

    def load_tokenizer(self) -> Any:
        return self.sources[0].load_tokenizer()

    def split(self, fraction: float) -> tuple[Mixture, Mixture]:
        """(the training part, the validation part): each source's last `fraction` of tokens held out."""
        parts = [source.held_out(fraction) for source in self.sources]
        return Mixture([t for t, _ in parts], self.weights), Mixture([v for _, v in parts], self.weights)

    @property
    def has_loss_mask(self) -> bool:
        return any(s.loss_mask is not None for s in self.sources)


def _tokenizer_bytes(data: PreparedData) -> bytes:
    path = data.tokenizer_path
    return path.read_bytes() if path is not None else b"byte"


class MixtureSampler:
    """Deterministic, resumable global batches drawn from a Mixture (the module docstring's table)."""

    def __init__(self, mixture: Mixture, seq_len: int, global_batch: int, seed: int) -> None:
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        self.weights = mixture.weights
        self.n_windows = [s.n_tokens // (self.seq_len + 1) for s in mixture.sources]
        for source, windows in zip(mixture.sources, self.n_windows, strict=True):
            if windows < 1:
                raise ValueError(
                    f"data source {source.path} holds no window of seq_len+1={self.seq_len + 1} tokens"
                )
        self.step = 0
        self._before = (0, np.zeros(len(self.weights), dtype=np.int64))  # (step, n_j before it)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._last: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None

    def _counts_before(self, step: int) -> np.ndarray:
        at, counts = self._before
        if step < at:
            at, counts = 0, np.zeros_like(counts)
        while at < step:
            counts = counts + np.bincount(self._choose(at, counts), minlength=len(counts))
            at += 1
        self._before = (at, counts)
        return counts

    def _choose(self, step: int, counts: np.ndarray) -> np.ndarray:
        """The source of each sample of `step`'s global batch, the counts before it given."""
        counts = counts.copy()
        chosen = np.empty(self.global_batch, dtype=np.int64)
        first = step * self.global_batch
        for i in range(self.global_batch):
            j = int(np.argmax(self.weights * (first + i + 1) - counts))
            chosen[i] = j
            counts[j] += 1
        return chosen

    def samples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each sample of the global batch at `step`, in stream order (the last step
        asked for is kept: a training step asks for its batch, its counts and its sources)."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        self._last = (step, self._samples(step))
        return self._last[1]

    def _samples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        counts = self._counts_before(step)
        chosen = self._choose(step, counts)
        windows = np.empty(self.global_batch, dtype=np.int64)
        for j in np.unique(chosen):
            picked = chosen == j
            n = counts[j] + np.arange(int(picked.sum()))
            epochs, offsets = np.divmod(n, self.n_windows[j])
            windows[picked] = [self._perm(int(j), int(e))[o] for e, o in zip(epochs, offsets, strict=True)]
        return chosen, windows

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4 * len(self.n_windows):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, source, epoch]).permutation(
                self.n_windows[source]
            )
        return self._perms[key]

    def _read(self, mixture: Mixture, chosen: np.ndarray, windows: np.ndarray, masks: bool) -> np.ndarray:
        """The windows' token ids (int64), or with `masks` whether each token counts (a source without a
        mask: all), [n, seq_len + 1]."""
        span = self.seq_len + 1
        idx = windows[:, None] * span + np.arange(span, dtype=np.int64)[None, :]
        out = np.ones(idx.shape, dtype=bool) if masks else np.empty(idx.shape, dtype=np.int64)
        for j in np.unique(chosen):
            picked, source = chosen == j, mixture.sources[int(j)]
            if not masks:
                out[picked] = source.tokens[idx[picked]]
            elif source.loss_mask is not None:
                out[picked] = source.loss_mask[idx[picked]] != 0
        return out

    def micro_batches(
        self, mixture: Mixture, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        """This rank's slice of the global batch at `step`, split into micro-batches of (inputs, targets)."""
        problem = batch_split_problem(self.global_batch, micro_batch, dp_size)
        if problem:
            raise ValueError(problem)
        per = self.global_batch // dp_size
        chosen, windows = self.samples(step)
        part = slice(dp_rank * per, (dp_rank + 1) * per)
        block = torch.from_numpy(self._read(mixture, chosen[part], windows[part], masks=False))
        counts = self._read(mixture, chosen[part], windows[part], masks=True)
        inputs, targets = block[:, :-1].contiguous(), block[:, 1:].contiguous()
        targets[~torch.from_numpy(counts[:, 1:])] = IGNORE_INDEX
        return list(zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True))

    def next_micro_batches(
        self, mixture: Mixture, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        batches = self.micro_batches(mixture, self.step, dp_rank, dp_size, micro_batch)
        self.step += 1
        return batches

    def counted_targets(self, mixture: Mixture, step: int) -> int | None:
        """Targets of the global batch at `step` that count (None: all, when no source has a mask)."""
        return int(self.counted_by_source(mixture, step).sum()) if mixture.has_loss_mask else None

    def samples_by_source(self, step: int) -> list[int]:
        """How many of the global batch's samples at `step` each source gave."""
        chosen, _ = self.samples(step)
        return np.bincount(chosen, minlength=len(self.weights)).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "taken": self._counts_before(self.step).tolist(),
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "n_windows": list(self.n_windows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "global_batch", "seed", "n_windows"):
            saved = state.get(key)
            saved = saved.tolist() if isinstance(saved, torch.Tensor) else saved
            mine = getattr(self, key)
            if (list(saved) if isinstance(mine, list) else saved) != mine:
                raise ValueError(
                    f"checkpointed mixture sampler has {key}={saved} but this run has {mine}; resume with the "
                    "same data.sources and data config, or start a fresh run"
                )
        taken = state["taken"]
        self.step = int(state["step"])
        self._before = (self.step, np.asarray(taken.tolist() if isinstance(taken, torch.Tensor) else taken))

    def counted_by_source(self, mixture: Mixture, step: int) -> np.ndarray:
        """Targets of the global batch at `step` that count, per source."""
        chosen, windows = self.samples(step)
        if not mixture.has_loss_mask:
            return np.bincount(chosen, minlength=len(self.weights)) * self.seq_len
        counts = self._read(mixture, chosen, windows, masks=True)[:, 1:].sum(axis=1)
        return np.bincount(chosen, weights=counts, minlength=len(self.weights))

    def source_sums(
        self, sequence_sums: dict[int, torch.Tensor], step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> torch.Tensor:
        """This rank's cross-entropy sums per source [K] (fp64) from its micro-batches' per-sequence sums
        (MicroBatchLoss.for_step) at `step`."""
        per = self.global_batch // dp_size
        chosen = torch.from_numpy(self.samples(step)[0][dp_rank * per : (dp_rank + 1) * per])
        out = torch.zeros(len(self.weights), dtype=torch.float64)
        for mb, sums in sequence_sums.items():
            out.index_add_(0, chosen[mb * micro_batch : (mb + 1) * micro_batch], sums.double().cpu())
        return out
