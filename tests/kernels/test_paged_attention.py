"""Decode and mixed prefill against the float64 oracle, on every backend that can run here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from tests.kernels.backends import ALL_BACKENDS
from tests.kernels.paged_case import assert_close, make_paged_case, oracle_decode, oracle_prefill, random_stored

HEADS = [(8, 8), (32, 8), (64, 8)]
MAX_CONTEXT = 4100


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh inputs every run; a failure prints the values


def decode_lengths(rng: np.random.Generator) -> list[int]:
    """Mixed lengths: a short one, a block-boundary one and two drawn from 1..4100."""
    return [int(rng.integers(1, 40)), 32, *rng.integers(1, MAX_CONTEXT + 1, size=2).tolist()]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_decode_matches_float64_oracle_and_ignores_unused_slots(rng, backend, dtype, block_size, head_dim, num_heads, num_kv_heads):
    case = make_paged_case(rng, decode_lengths(rng), num_kv_heads, head_dim, block_size, dtype)
    queries = random_stored(rng, (len(case.context_lens), num_heads, head_dim), dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_attention(
        queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens, scale=scale, backend=backend
    )
    assert out.dtype == queries.dtype
    assert_close(out, oracle_decode(case, queries, scale), dtype)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_mix_of_decode_rows_and_chunks_matches_oracle(rng, backend, dtype, num_heads, num_kv_heads):
    head_dim, block_size = 64, 16
    # decode, chunk on cached context, decode, whole-prompt chunk, decode: interleaved on purpose
    q_lens = np.array([1, int(rng.integers(2, 40)), 1, int(rng.integers(2, 70)), 1], dtype=np.int32)
    cached = np.array([int(rng.integers(1, 300)), int(rng.integers(0, 200)), 5, 0, int(rng.integers(1, 2000))])
    lengths = (q_lens + cached).astype(np.int32)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, block_size, dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    queries = random_stored(rng, (int(starts[-1]), num_heads, head_dim), dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_prefill_attention(
        queries, case.key_cache, case.value_cache, mx.array(case.block_tables), mx.array(starts),
        mx.array(case.context_lens), scale=scale, backend=backend,
    )
    assert_close(out, oracle_prefill(case, queries, starts, scale), dtype)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_prefill_of_decode_rows_only_agrees_with_paged_attention(rng, backend):
    case = make_paged_case(rng, [7, 130, 33], 2, 64, 16, "float32")
    queries = random_stored(rng, (3, 8, 64), "float32")
    starts = np.arange(4, dtype=np.int32)
    args = (queries, case.key_cache, case.value_cache, case.block_tables)
    prefill = kernels.paged_prefill_attention(*args, starts, case.context_lens, scale=0.125, backend=backend)
    decode = kernels.paged_attention(*args, case.context_lens, scale=0.125, backend=backend)
    if backend == "reference":  # the same gathers and SDPA calls
        np.testing.assert_array_equal(np.array(prefill), np.array(decode))
    else:  # the varlen kernel and the decode kernel sum in different orders
        np.testing.assert_allclose(np.array(prefill), np.array(decode), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_prefill_skips_sequences_with_no_new_queries(rng, backend):
    case = make_paged_case(rng, [20, 9, 40], 4, 64, 16, "float32")
    starts = np.array([0, 3, 3, 4], dtype=np.int32)  # the middle sequence contributes no rows
    queries = random_stored(rng, (4, 8, 64), "float32")
    out = kernels.paged_prefill_attention(
        queries, case.key_cache, case.value_cache, case.block_tables, starts, case.context_lens, scale=0.125, backend=backend
    )
    assert_close(out, oracle_prefill(case, queries, starts, 0.125), "float32")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mqa_single_kv_head_serves_every_query_head(rng, backend):
    case = make_paged_case(rng, [1, 17, 300], 1, 128, 32, "float16")
    queries = random_stored(rng, (3, 16, 128), "float16")
    out = kernels.paged_attention(
        queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens, scale=0.09, backend=backend
    )
    assert_close(out, oracle_decode(case, queries, 0.09), "float16")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_metadata_as_lists_and_mx_arrays_give_the_same_output(rng, backend):
    case = make_paged_case(rng, [5, 70], 2, 64, 16, "float32")
    queries = random_stored(rng, (2, 4, 64), "float32")
    args = (queries, case.key_cache, case.value_cache)
    from_lists = kernels.paged_attention(*args, case.block_tables.tolist(), case.context_lens.tolist(), scale=0.1, backend=backend)
    from_mx = kernels.paged_attention(
        *args, mx.array(case.block_tables), mx.array(case.context_lens), scale=0.1, backend=backend
    )
    # On the reference backend host lists take the length-grouped path and device arrays the on-device
    # decode over the tables' whole width (orchard/kernels/dispatch.py): the sums run over different masked
    # lengths, so they may differ in their last bit.
    np.testing.assert_allclose(np.array(from_lists), np.array(from_mx), rtol=1e-5, atol=1e-6)
