"""Training data: tokenizers, corpora, prepared token datasets and the batch sampler.

tokenizer.py  byte-level tokens, any `tokenizer.json`, and a BPE trained on the corpus
corpus.py     which files make a corpus and how documents are read from them
dataset.py    a prepared dataset on disk (one token memmap) and `prepare_data`, the default corpus
sampler.py    deterministic, resumable global batches that never depend on the parallel layout
"""


class DataError(ValueError):
    """A dataset or tokenizer is missing, malformed or inconsistent; the message says how to fix it."""


# A target that does not count (a prompt token, padding): 0 loss, no gradient. PyTorch's and
# transformers' convention, so labels prepared for either mean the same here.
IGNORE_INDEX = -100
