"""Layer placement over pipeline stages and virtual stages."""

import pytest

from megatron_zpp.pipeline_parallel import stage_layers, virtual_stage_layers


def test_even_split_covers_every_layer_once():
    assert [stage_layers(8, 4, s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(5, 1, 0) == [0, 1, 2, 3, 4]


def test_uneven_first_and_last_stage():
    placed = [stage_layers(10, 4, s, first=1, last=1) for s in range(4)]
    assert placed == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert [stage_layers(6, 3, s, first=2) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError):
        stage_layers(9, 4, 0, first=1, last=1)


def test_interleaved_chunks_are_round_robin():
    # 8 layers, PP 2, 2 layers per virtual stage: stage 0 holds chunks 0 and 2
    assert virtual_stage_layers(8, 2, 2, 0) == [[0, 1], [4, 5]]
    assert virtual_stage_layers(8, 2, 2, 1) == [[2, 3], [6, 7]]
    every = sorted(layer for s in range(4) for chunk in virtual_stage_layers(16, 4, 1, s) for layer in chunk)
    assert every == list(range(16))
