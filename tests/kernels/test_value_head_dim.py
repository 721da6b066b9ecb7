"""Values of another head dim than keys (DeepSeek-V2: keys 192, values 128): the reference and the CPU
kernel attend over them against the float64 oracle, outputs take the values' width, KV writes store each
at its own width, and the GPU backends refuse such caches, so a model chooses a host-planned one once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from orchard.kernels.dispatch import backend_for_head_dims, check_head_dims, head_dims_reason
from orchard.kernels.reference import paged_decode_on_device
from orchard.kernels.variants import layer_attention
from tests.kernels.backends import HOST_PLANNED
from tests.kernels.paged_case import Rules, assert_close, make_paged_case, oracle_decode, oracle_prefill, random_stored

KEY_DIM, VALUE_DIM = 24, 12
RULES = [Rules(), Rules(window=5), Rules(softcap=2.0), Rules(sinks=np.linspace(-1.0, 1.0, 4))]


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("backend", HOST_PLANNED)
@pytest.mark.parametrize("rules", RULES, ids=["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_over_narrower_values_matches_float64_oracle(rng, rules, dtype, backend):
    case = make_paged_case(rng, [1, 9, 33, 70], 4, KEY_DIM, 8, dtype, value_head_dim=VALUE_DIM)
    queries = random_stored(rng, (4, 4, KEY_DIM), dtype)
    scale = KEY_DIM ** -0.5
    out = kernels.paged_attention(queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
                                  scale=scale, backend=backend, **rules.kwargs())
    assert out.shape == (4, 4, VALUE_DIM) and out.dtype == queries.dtype
    assert_close(out, oracle_decode(case, queries, scale, rules), dtype)


@pytest.mark.parametrize("rules", RULES, ids=["plain", "window", "softcap", "sinks"])
def test_decode_with_metadata_on_the_device_matches_float64_oracle(rng, rules):
    """The path a compiled decode graph traces: tables and lengths stay device arrays."""
    case = make_paged_case(rng, [3, 17, 40], 2, KEY_DIM, 8, "float32", value_head_dim=VALUE_DIM)
    queries = random_stored(rng, (3, 4, KEY_DIM), "float32")
    layer = layer_attention(rules.window, rules.softcap, rules.kwargs()["sinks"])
    out = paged_decode_on_device(queries, case.key_cache, case.value_cache, mx.array(case.block_tables),
                                 mx.array(case.context_lens), 0.2, layer)
    assert_close(out, oracle_decode(case, queries, 0.2, rules), "float32")


@pytest.mark.parametrize("backend", HOST_PLANNED)
@pytest.mark.parametrize("rules", RULES, ids=["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("value_dim", [VALUE_DIM, 40], ids=["narrower", "wider"])
def test_mixed_step_of_chunks_and_decodes_matches_float64_oracle(rng, rules, value_dim, backend):
    q_lens = np.array([1, 7, 1, 12], dtype=np.int32)
    lengths = (q_lens + np.array([20, 5, 3, 0])).astype(np.int32)
    case = make_paged_case(rng, lengths, 2, KEY_DIM, 4, "float32", value_head_dim=value_dim)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    queries = random_stored(rng, (int(starts[-1]), 4, KEY_DIM), "float32")
    out = kernels.paged_prefill_attention(queries, case.key_cache, case.value_cache, case.block_tables, starts,
                                          case.context_lens, scale=0.2, backend=backend, **rules.kwargs())
    assert out.shape == (int(starts[-1]), 4, value_dim)
    assert_close(out, oracle_prefill(case, queries, starts, 0.2, rules), "float32")


def test_kv_writes_store_keys_and_values_each_at_its_width():
    key_cache, value_cache = mx.zeros((3, 4, 2, KEY_DIM)), mx.zeros((3, 4, 2, VALUE_DIM))
    keys, values = mx.ones((2, 2, KEY_DIM)), 2 * mx.ones((2, 2, VALUE_DIM))
    k, v = kernels.write_kv(key_cache, value_cache, keys, values, [5, 9])
    assert float(k.sum()) == 2 * 2 * KEY_DIM and float(v.sum()) == 2 * 2 * 2 * VALUE_DIM
    assert float(v[1, 1].sum()) == 2 * 2 * VALUE_DIM and float(v[2, 1].sum()) == 2 * 2 * VALUE_DIM
    with pytest.raises(kernels.InvalidAttentionMetadata, match="values"):
        kernels.write_kv(key_cache, value_cache, keys, keys, [5, 9])


def test_gpu_backends_refuse_two_head_dims_and_a_model_gets_a_host_planned_one():
    assert head_dims_reason("reference", KEY_DIM, VALUE_DIM) is None
    assert head_dims_reason("cpu", KEY_DIM, VALUE_DIM) is None
    assert head_dims_reason("cuda", KEY_DIM, KEY_DIM) is None
    assert "one head dim" in head_dims_reason("metal", KEY_DIM, VALUE_DIM)
    with pytest.raises(kernels.UnsupportedAttentionShape, match="reference backend"):
        check_head_dims("cuda", mx.zeros((2, 4, 1, KEY_DIM)), mx.zeros((2, 4, 1, VALUE_DIM)))
    default = kernels.default_backend()
    assert backend_for_head_dims(None, KEY_DIM, VALUE_DIM) == (default if default in kernels.HOST_PLANNED else "reference")
    assert backend_for_head_dims("cuda" if "cuda" in kernels.available_backends() else "reference", KEY_DIM, VALUE_DIM) == "reference"
    assert backend_for_head_dims("reference", KEY_DIM, KEY_DIM) == "reference"
