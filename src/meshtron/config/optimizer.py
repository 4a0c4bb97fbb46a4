"""Which parameters each optimizer trains, by name (torch-free: the planner and the trainer both ask).

`training.optimizer = "muon"` trains with Muon every 2-D weight inside a transformer block (the model's
layers and the MTP module's block): attention projections, MLP projections, each routed expert's w1, w2
and w3 (an expert stack [E, A, B] is E matrices) and the shared experts'. Everything else takes AdamW:
embeddings, the output head, norms, biases, the router and the shared experts' gate (scores, not hidden
features), and MTP's projection.
"""

from __future__ import annotations

import re

_BLOCK_MATRIX = re.compile(r"^(layers\.\d+|mtp\.\d+\.block)\.")
_GATES = re.compile(r"\.(router|shared_gate)\.")


def is_muon_matrix(name: str, ndim: int) -> bool:
    """Whether parameter `name` (of `ndim` dims) is trained by Muon under training.optimizer = "muon"."""
    return ndim >= 2 and bool(_BLOCK_MATRIX.match(name)) and not _GATES.search(name)
