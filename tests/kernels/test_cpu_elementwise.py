"""The CPU kernels' elementwise ops (orchard/kernels/cpu/elementwise.cpp), each bit for bit what MLX computes:
SwiGLU as mlx-lm's own `swiglu` over every float a gate can hold that matters (the exp's clamps, NaN, infinities,
signed zeros); the rotation as `mx.fast.rope` once its tables are made; both refusing what they cannot compute.
tests/node/model/test_fused_layers.py and test_positions.py check which models run them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from orchard.kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.loaded(), reason="the CPU kernels extension is not built here")
on_cpu = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX computes on a GPU here")


def same_bits(a: mx.array, b: mx.array) -> np.ndarray:
    x, y = np.array(a), np.array(b)
    return (x.view(np.uint32) == y.view(np.uint32)) | (np.isnan(x) & np.isnan(y))


def gates_that_matter() -> np.ndarray:
    """Every 2^-14-th float in [-100, 100] (both sides of the exp's +-88 clamps, every rounding of its
    floor(x + 0.5)), the floats right around the clamps and zero, NaN and both infinities."""
    sweep = np.arange(-100.0, 100.0, 2.0**-14, dtype=np.float32)
    edges = [np.nextafter(np.float32(v), np.float32(d)) for v in (88.0, -88.0, 0.0) for d in (-np.inf, np.inf)]
    special = np.array([np.nan, np.inf, -np.inf, 88.0, -88.0, 0.0, -0.0, 1e-38, -1e-38, 3.4e38, -3.4e38], np.float32)
    return np.concatenate([sweep, np.array(edges, np.float32), special])


@needs_kernel
@on_cpu
@pytest.mark.parametrize("width", [1, 7, 512])
def test_the_kernel_equals_mlx_lms_swiglu_bit_for_bit(width):
    gates = gates_that_matter()
    gates = np.pad(gates, (0, (-gates.size) % width)).reshape(-1, width)
    ups = np.random.default_rng(width).normal(size=gates.shape).astype(np.float32) * 3
    gate, up = mx.array(gates), mx.array(ups)
    ours = cpu.swiglu(mx.concatenate([gate, up], axis=1), width)
    theirs = mlx_lm_swiglu(gate, up)
    assert ours.shape == theirs.shape and ours.dtype == mx.float32
    assert same_bits(ours, theirs).all(), f"{int((~same_bits(ours, theirs)).sum())} floats differ"


@needs_kernel
@on_cpu
def test_a_strided_input_is_read_as_its_values_not_its_memory():
    rows = mx.random.normal((2 * 16, 16), key=mx.random.key(3))
    gate_up = rows.T  # a transposed view: [16, 32], columns in memory
    ours = cpu.swiglu(gate_up, 16)
    assert same_bits(ours, mlx_lm_swiglu(gate_up[:, :16], gate_up[:, 16:])).all()


@needs_kernel
@on_cpu
@pytest.mark.parametrize("heads, width", [(4, 64), (2, 64), (8, 128), (1, 2)])
def test_the_rotation_equals_mx_fast_rope_bit_for_bit_given_the_ropes_own_tables(heads, width):
    rows, half = 37, width // 2
    positions = mx.array(np.random.default_rng(width).integers(0, 100_000, rows).astype(np.int32))
    x = mx.random.normal((rows, heads, 1, width), key=mx.random.key(heads)) * 5
    probe = mx.concatenate([mx.ones((rows, 1, 1, half)), mx.zeros((rows, 1, 1, half))], axis=-1)
    tables = mx.fast.rope(probe, width, traditional=False, base=500_000.0, scale=1.0, offset=positions)
    cos, sin = tables.reshape(rows, width)[:, :half], tables.reshape(rows, width)[:, half:]
    ours = cpu.rotate_rows(x, cos, sin)
    theirs = mx.fast.rope(x, width, traditional=False, base=500_000.0, scale=1.0, offset=positions)
    assert ours.shape == x.shape
    assert same_bits(ours, theirs).all(), f"{int((~same_bits(ours, theirs)).sum())} floats differ"


@needs_kernel
@pytest.mark.parametrize("make", [
    lambda: (mx.zeros((4, 2, 8), dtype=mx.bfloat16), mx.zeros((4, 4)), mx.zeros((4, 4))),  # float32 only
    lambda: (mx.zeros((4, 2, 7)), mx.zeros((4, 3)), mx.zeros((4, 3))),  # an odd width has no halves
    lambda: (mx.zeros((4, 2, 8)), mx.zeros((3, 4)), mx.zeros((3, 4))),  # tables of other rows
    lambda: (mx.zeros((4, 2, 8)), mx.zeros((4, 4)), mx.zeros((4, 2))),  # sin not as cos
    lambda: (mx.zeros((8,)), mx.zeros((4, 4)), mx.zeros((4, 4))),  # no rows
    lambda: (mx.zeros((4, 2, 0)), mx.zeros((4, 0)), mx.zeros((4, 0))),  # nothing to rotate
    lambda: (mx.zeros((1, 2, 2)), mx.array(1.0), mx.array(1.0)),  # tables without rows
], ids=["bfloat16", "odd-width", "other-rows", "sin-shape", "one-dim", "zero-width", "scalar-tables"])
def test_a_rotation_it_cannot_compute_is_refused_by_name(make):
    with pytest.raises(ValueError, match="orchard rotate_rows"):
        cpu.rotate_rows(*make())


@needs_kernel
@pytest.mark.parametrize("make", [
    lambda: (mx.zeros((4, 8), dtype=mx.bfloat16), 4),  # float32 only
    lambda: (mx.zeros((4, 8)), 3),  # not two halves
    lambda: (mx.zeros((2, 4, 8)), 4),  # not [rows, 2 * intermediate]
    lambda: (mx.zeros((4, 8)), 0),
], ids=["bfloat16", "odd-split", "three-dims", "zero-width"])
def test_what_it_cannot_compute_is_refused_by_name(make):
    gate_up, width = make()
    with pytest.raises(ValueError, match="orchard swiglu"):
        cpu.swiglu(gate_up, width)


def test_the_elementwise_ops_are_offered_for_float32_on_the_cpu_only():
    assert cpu.ELEMENTWISE_DTYPE == mx.float32
    assert cpu.elementwise_serve_here() == (cpu.loaded() and mx.default_device() == mx.cpu)
