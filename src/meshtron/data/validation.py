"""The validation split: held-out tokens, disjoint from training, and the fixed batches evaluated on them.

  data.val_fraction = f   the last f of the prepared tokens are held out: training samples only the tokens
                          before the cut, validation only those after it, so no window is in both
  data.val_path = DIR     a separately prepared dataset (same tokenizer) is the validation data; the
                          training data is used whole

With neither (the default) the training data and its sampling are exactly as without this module.

The held-out part is the corpus's tail rather than a random choice of windows: windows drawn from the same
files as the training windows would overlap their documents, so a tail split measures what a model does
on text it has not seen. The evaluated batches are the first `training.eval_batches` global batches of a
`BatchSampler` over the validation tokens (epoch 0, same seed): a fixed, layout-independent set of windows
spread over the whole held-out part, the same at every evaluation, so the curve compares like with like.
"""

from __future__ import annotations

import math

from meshtron.config.schema import Config, TrainingConfig
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData
from meshtron.data.mixture import Mixture, MixtureSampler
from meshtron.data.sampler import BatchSampler


def _same_tokenizer_problem(train: PreparedData, val: PreparedData) -> str | None:
    if (train.loss_mask is None) != (val.loss_mask is None):  # the two losses would count other targets
        which = "has a loss mask (chat data)" if val.loss_mask is not None else "has no loss mask"
        return (
            f"data.val_path={str(val.path)!r} {which} and the training data ({train.path}) does not; prepare "
            "both the same way (both with --chat, or neither)"
        )
    if (val.vocab_size, val.eos_id, val.tokenizer_spec) == (
        train.vocab_size,
        train.eos_id,
        train.tokenizer_spec,
    ):
        train_tok, val_tok = train.tokenizer_path, val.tokenizer_path
        if train_tok is None or train_tok.read_bytes() == val_tok.read_bytes():
            return None
    return (
        f"data.val_path={str(val.path)!r} was prepared with another tokenizer than the training data "
        f"({train.path}); prepare it with `meshtron prepare-data ... --tokenizer {train.tokenizer_path or 'byte'}`"
    )


def _at_least(part: int, whole: int) -> str:
    """The fraction `part / whole`, rounded up at its third significant digit (a fix that suffices)."""
    fraction = part / whole
    scale = 10 ** (2 - math.floor(math.log10(fraction)))
    return f"{math.ceil(fraction * scale) / scale:g}"


def split_validation(cfg: Config, train: PreparedData) -> tuple[PreparedData, PreparedData | None]:
    """(the training data, the validation data or None), per data.val_fraction / data.val_path. Refuses,
    before any training, a validation set too small for `training.eval_batches` global batches of distinct
    windows, and a training part too small for one."""
    d, t = cfg.data, cfg.training
    if d.val_path:
        val = PreparedData.open(d.val_path)
        problem = _same_tokenizer_problem(train, val)
        if problem:
            raise DataError(problem)
    elif d.val_fraction > 0:
        train, val = (
            train.split(d.val_fraction) if isinstance(train, Mixture) else train.held_out(d.val_fraction)
        )
    else:
        return train, None
    span, needed = t.seq_len + 1, t.eval_batches * t.global_batch
    if val.n_tokens // span < needed:
        where = f"data.val_path={d.val_path!r}" if d.val_path else f"data.val_fraction={d.val_fraction}"
        fix = (
            "prepare more validation text"
            if d.val_path
            else f"raise data.val_fraction to at least {_at_least(needed * span, train.n_tokens + val.n_tokens)}"
        )
        raise DataError(
            f"the validation data ({where}: {val.n_tokens:,} tokens) holds {val.n_tokens // span} windows of "
            f"seq_len+1={span} tokens, fewer than training.eval_batches x global_batch = {t.eval_batches} x "
            f"{t.global_batch} = {needed}; {fix}, or lower training.eval_batches"
        )
    if train.n_tokens // span < t.global_batch:
        raise DataError(
            f"data.val_fraction={d.val_fraction} leaves {train.n_tokens:,} training tokens, fewer than one "
            f"global batch of {t.global_batch} x {span} tokens; lower data.val_fraction"
        )
    return train, val


def validation_sampler(t: TrainingConfig, val: PreparedData | Mixture) -> BatchSampler | MixtureSampler:
    """The sampler whose first `eval_batches` steps are the evaluated batches."""
    if isinstance(val, Mixture):
        return MixtureSampler(val, t.seq_len, t.global_batch, t.seed)
    return BatchSampler(val.n_tokens, t.seq_len, t.global_batch, t.seed)
