"""Pipeline layer split: even, weighted by embedding and head, explicit, and the errors."""

from __future__ import annotations

import pytest

from meshtron.schedules.actions import chunks_of_rank
from meshtron.schedules.split import split_layers


def test_even_split_covers_every_layer_once_in_order():
    for n_layers in range(1, 17):
        for chunks in range(1, n_layers + 1):
            split = split_layers(n_layers, chunks)
            assert [i for chunk in split for i in chunk] == list(range(n_layers))
            sizes = [len(c) for c in split]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_embedding_and_head_counted_as_layers_lighten_the_ends():
    assert [len(c) for c in split_layers(8, 4)] == [2, 2, 2, 2]
    sizes = [len(c) for c in split_layers(10, 4, embedding_weight=1.0, head_weight=1.0)]
    assert sum(sizes) == 10 and sizes[0] <= sizes[1] and sizes[-1] <= sizes[-2]
    assert [len(c) for c in split_layers(14, 4, embedding_weight=1.0, head_weight=1.0)] == [3, 4, 4, 3]


def test_explicit_split():
    assert split_layers(6, 3, explicit=[1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="adding up to model.n_layers=6"):
        split_layers(6, 3, explicit=[1, 3, 3])
    with pytest.raises(ValueError, match=r"parallel.pp_layers=\[3, 3\] must give pp\*vpp=3 layer counts"):
        split_layers(6, 3, explicit=[3, 3])
    with pytest.raises(ValueError, match=r"each positive \(the first and last may be 0"):
        split_layers(6, 3, explicit=[3, 0, 3])  # a middle chunk with nothing to run


def test_edge_chunks_may_hold_the_embedding_or_the_head_alone():
    """Megatron's embedding and loss counted as a layer each: Qwen3-235B's 94 layers over 96 chunks."""
    split = split_layers(94, 96, embedding_weight=1.0, head_weight=1.0)
    assert split[0] == [] and split[-1] == [] and all(len(c) == 1 for c in split[1:-1])
    assert [len(c) for c in split_layers(94, 95, embedding_weight=1.0, head_weight=1.0)][-2:] == [1, 0]
    assert split_layers(3, 3, explicit=[0, 3, 0]) == [[], [0, 1, 2], []]
    # Layers enough for every chunk: none is left empty, whatever the weights.
    for n_layers in range(4, 12):
        assert min(map(len, split_layers(n_layers, 4, embedding_weight=1.0, head_weight=2.0))) >= 1
    with pytest.raises(ValueError, match=r"use pp\*vpp <= 95 \(or weigh the embedding and the head"):
        split_layers(94, 96, embedding_weight=1.0)


def test_too_many_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"n_layers=4 cannot fill pp\*vpp=8 pipeline chunks"):
        split_layers(4, 8)
    with pytest.raises(ValueError, match=r"use pp\*vpp <= 6$"):
        split_layers(4, 8, embedding_weight=1.0, head_weight=1.0)


def test_interleaved_chunk_ownership():
    assert chunks_of_rank(1, pp=4, vpp=2, name="interleaved") == [1, 5]
    assert sorted(c for r in range(4) for c in chunks_of_rank(r, 4, 3, "interleaved")) == list(range(12))
