"""The batch sampler: deterministic, resumable global batches that never depend on the parallel layout.

The sampler depends only on the token count and its own arguments, never on the parallel layout, so any
mix of data/tensor/pipeline parallelism (and any resume point) sees exactly the same global batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshtron.data import IGNORE_INDEX
from meshtron.data.dataset import PreparedData
from meshtron.rules.data import batch_split_problem

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchSampler:
    """Deterministic, resumable global batches of non-overlapping ``seq_len + 1`` token windows.

    Window ``w`` covers tokens ``[w*(seq_len+1), (w+1)*(seq_len+1))``. Epoch ``e`` visits all windows in the
    permutation drawn from ``default_rng([seed, e])``; the epochs are concatenated into one stream and step
    ``s`` takes stream positions ``[s*global_batch, (s+1)*global_batch)``. Data-parallel ranks take
    contiguous slices of that batch, so the global batch never depends on the layout.
    """

    def __init__(self, n_tokens: int, seq_len: int, global_batch: int, seed: int) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy SeedSequence requirement), got {seed}")
        self.n_tokens = int(n_tokens)
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.n_windows = self.n_tokens // (self.seq_len + 1)
        if self.n_windows < self.global_batch:
            raise ValueError(
                f"the corpus ({self.n_tokens} tokens) holds {self.n_windows} windows of seq_len+1="
                f"{self.seq_len + 1} tokens, fewer than one global batch of {self.global_batch}; use more "
                "data, a shorter seq_len or a smaller global batch"
            )
        self.step = 0  # next step the next_* helpers will return; this is all a resume needs
        # Permutations are O(n_windows) to draw; a step touches at most two epochs, so two suffice.
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.n_windows / self.global_batch

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of the global batch at ``step`` (length global_batch)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.n_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def _check(self, dataset: PreparedData, dp_rank: int, dp_size: int, micro_batch: int = 1) -> None:
        if dataset.n_tokens != self.n_tokens:
            raise ValueError(
                f"sampler was built for {self.n_tokens} tokens but the dataset at {dataset.path} has "
                f"{dataset.n_tokens}; build the sampler from this dataset's n_tokens"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        problem = batch_split_problem(self.global_batch, micro_batch, dp_size)
        if problem:
            raise ValueError(problem)

    def rank_batch(self, dataset: PreparedData, step: int, dp_rank: int, dp_size: int) -> Batch:
        """``(inputs, targets)`` int64 ``[global_batch // dp_size, seq_len]``: this rank's contiguous slice."""
        self._check(dataset, dp_rank, dp_size)
        return self._slice(dataset, step, dp_rank, dp_size)

    def _token_index(self, windows: np.ndarray) -> np.ndarray:
        span = self.seq_len + 1
        return windows[:, None] * span + np.arange(span, dtype=np.int64)[None, :]

    def _slice(self, dataset: PreparedData, step: int, dp_rank: int, dp_size: int) -> Batch:
        per = self.global_batch // dp_size
        idx = self._token_index(self.global_indices(step)[dp_rank * per : (dp_rank + 1) * per])
        block = torch.from_numpy(np.asarray(dataset.tokens[idx], dtype=np.int64))
        inputs, targets = block[:, :-1].contiguous(), block[:, 1:].contiguous()
        if dataset.loss_mask is not None:  # targets that do not count: the loss ignores them
            counts = torch.from_numpy(np.asarray(dataset.loss_mask[idx[:, 1:]], dtype=bool))
            targets[~counts] = IGNORE_INDEX
        return inputs, targets

    def counted_targets(self, dataset: PreparedData, step: int, part: tuple[int, int] = (0, 1)) -> int | None:
        """Targets of the global batch at `step` that count in the loss (a dataset with a loss mask: the
        whole batch's, read by every rank, so no layout needs a collective for it); None: all of them.
        `part` (index, parts): of that contiguous share of the batch only (a DiLoCo replica's)."""
        if dataset.loss_mask is None:
            return None
        index, parts = part
        per = self.global_batch // parts
        windows = self.global_indices(step)[index * per : (index + 1) * per]
        return int(np.count_nonzero(dataset.loss_mask[self._token_index(windows)[:, 1:]]))

    def micro_batches(
        self, dataset: PreparedData, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        """This rank's slice split into ``global_batch // (dp_size * micro_batch)`` micro-batches."""
        self._check(dataset, dp_rank, dp_size, micro_batch)
        inputs, targets = self._slice(dataset, step, dp_rank, dp_size)
        return list(zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True))

    def next_rank_batch(self, dataset: PreparedData, dp_rank: int, dp_size: int) -> Batch:
        batch = self.rank_batch(dataset, self.step, dp_rank, dp_size)
        self.step += 1
        return batch

    def next_micro_batches(
        self, dataset: PreparedData, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[Batch]:
        batches = self.micro_batches(dataset, self.step, dp_rank, dp_size, micro_batch)
        self.step += 1
        return batches

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "n_tokens": self.n_tokens,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_tokens", "seq_len", "global_batch", "seed"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; it is not a BatchSampler state_dict")
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"checkpointed sampler has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resume with the same dataset and data config, or start a fresh run"
                )
        step = int(state.get("step", -1))
        if step < 0:
            raise ValueError(f"sampler state has invalid step {state.get('step')!r}")
        self.step = step
