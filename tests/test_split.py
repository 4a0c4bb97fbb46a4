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
    with pytest.raises(
        ValueError, match=r"parallel.pp_layers=\[3, 3\] must give pp\*vpp=3 positive layer counts"
    ):
        split_layers(6, 3, explicit=[3, 3])


def test_too_many_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"n_layers=4 cannot fill pp\*vpp=8 pipeline chunks"):
        split_layers(4, 8)


def test_interleaved_chunk_ownership():
    assert chunks_of_rank(1, pp=4, vpp=2, name="interleaved") == [1, 5]
    assert sorted(c for r in range(4) for c in chunks_of_rank(r, 4, 3, "interleaved")) == list(range(12))
