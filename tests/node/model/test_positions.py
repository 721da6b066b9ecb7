"""Packed positions' rotation tables (orchard/node/model/positions.py): on the CPU a step's ropes rotate with
tables made once from the model's own rope, every row the same bits as the rope itself would give; a rope the
tables cannot stand for (traditional, scaled inputs, half precision) runs as it is."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from orchard.kernels import cpu as cpu_kernels
from orchard.node.model.positions import PackedPositions, PositionalRoPE

tables_here = pytest.mark.skipif(not cpu_kernels.loaded() or mx.default_device() != mx.cpu,
                                 reason="rotation tables serve MLX's CPU build with the CPU kernels")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def positions(rows: int = 29) -> PackedPositions:
    return PackedPositions(mx.array(np.random.default_rng(rows).integers(0, 60_000, rows).astype(np.int32)))


def same_bits(a: mx.array, b: mx.array) -> bool:
    return bool((np.array(a).view(np.uint32) == np.array(b).view(np.uint32)).all())


@tables_here
@pytest.mark.parametrize("make", [lambda: nn.RoPE(64, base=10_000.0), lambda: nn.RoPE(64, base=10_000.0, scale=0.25),
                                  lambda: initialize_rope(64, 500_000.0, False, LLAMA3_SCALING, 131_072)],
                         ids=["plain", "scaled-positions", "llama3"])
def test_a_tabled_rope_rotates_every_row_as_the_rope_itself(make):
    rope, packed = make(), positions()
    wrapped = PositionalRoPE(rope)
    assert wrapped.table_key is not None
    for heads in (4, 2, 4):  # queries, keys, the next layer's queries: one table for the step
        x = mx.random.normal((29, heads, 1, 64), key=mx.random.key(heads)) * 4
        assert same_bits(wrapped(x, offset=packed), rope(x, offset=packed.array))
    assert len(packed.tables) == 1


@tables_here
def test_layers_with_equal_ropes_share_the_steps_table_and_other_ropes_get_their_own():
    packed = positions()
    layers = [PositionalRoPE(nn.RoPE(64, base=10_000.0)) for _ in range(3)]
    other = PositionalRoPE(nn.RoPE(64, base=1_000_000.0))
    x = mx.random.normal((29, 2, 1, 64))
    for rope in layers + [other]:
        assert same_bits(rope(x, offset=packed), rope.inner(x, offset=packed.array))
    assert len(packed.tables) == 2
    assert len(positions().tables) == 0  # a new step starts with none


@pytest.mark.parametrize("rope, dtype", [(nn.RoPE(64, traditional=True), mx.float32),
                                         (nn.RoPE(64, base=10_000.0), mx.bfloat16),
                                         (nn.RoPE(32, base=10_000.0), mx.float32)],
                         ids=["traditional", "bfloat16", "partial-rotary"])
def test_a_rope_the_tables_cannot_stand_for_runs_as_it_is(rope, dtype):
    packed = positions()
    x = (mx.random.normal((29, 4, 1, 64)) * 4).astype(dtype)
    out = PositionalRoPE(rope)(x, offset=packed)
    assert len(packed.tables) == 0
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(rope(x, offset=packed.array).astype(mx.float32)))


def test_a_rope_that_scales_its_input_has_no_table_key():
    yarn = initialize_rope(64, 10_000.0, False, {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 4096}, 16_384)
    assert PositionalRoPE(yarn).table_key is None
    assert PositionalRoPE(nn.RoPE(64, traditional=True)).table_key is None
