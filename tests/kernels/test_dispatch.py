"""Backend choice: argument over environment over device default, and named errors for bad requests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from orchard.kernels import backends


def test_reference_is_always_available_and_last():
    assert kernels.available_backends()[-1] == "reference"


def test_default_is_the_first_available_backend_without_override(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.default_backend() == kernels.available_backends()[0]


@pytest.mark.parametrize("cpu_kernel,expected", [(False, "reference"), (True, "cpu")])
def test_default_on_a_machine_without_gpu_is_the_cpu_kernel_where_built(monkeypatch, cpu_kernel, expected):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "metal_available", lambda: False)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "cpu_kernel_available", lambda: cpu_kernel)
    assert kernels.default_backend() == expected


@pytest.mark.parametrize("metal,cuda,expected", [(True, False, "metal"), (False, True, "cuda")])
def test_default_prefers_the_device_kernel(monkeypatch, metal, cuda, expected):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "cpu_kernel_available", lambda: True)
    monkeypatch.setattr(backends, "metal_available", lambda: metal)
    monkeypatch.setattr(backends, "cuda_available", lambda: cuda)
    assert kernels.default_backend() == expected


def test_environment_variable_overrides_the_device_default(monkeypatch):
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setenv(kernels.ENV_VAR, "Reference")
    assert kernels.default_backend() == "reference"
    assert backends.resolve_backend(None) == "reference"


def test_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert backends.resolve_backend("cuda") == "cuda"


def test_unknown_backend_name_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "tpu")
    with pytest.raises(kernels.UnknownBackend, match="tpu"):
        kernels.default_backend()
    with pytest.raises(kernels.UnknownBackend):
        backends.resolve_backend("opencl")


def test_backend_missing_on_this_machine_is_refused(monkeypatch):
    monkeypatch.setattr(backends, "metal_available", lambda: False)
    with pytest.raises(kernels.BackendUnavailable, match="metal"):
        backends.resolve_backend("metal")


def _tiny_pool():
    cache = mx.zeros((4, 16, 2, 64))
    return mx.zeros((2, 4, 64)), cache, cache


def test_context_longer_than_the_block_table_is_refused():
    queries, k, v = _tiny_pool()
    with pytest.raises(kernels.InvalidAttentionMetadata, match="context_lens"):
        kernels.paged_attention(queries, k, v, [[1, 2], [3, 0]], [33, 5], scale=0.1, backend="reference")


def test_block_id_outside_the_pool_is_refused():
    queries, k, v = _tiny_pool()
    with pytest.raises(kernels.InvalidAttentionMetadata, match="block ids"):
        kernels.paged_attention(queries, k, v, [[1, 4], [3, 0]], [20, 5], scale=0.1, backend="reference")


def test_heads_that_do_not_group_are_refused():
    cache = mx.zeros((4, 16, 3, 64))
    with pytest.raises(kernels.InvalidAttentionMetadata, match="multiple"):
        kernels.paged_attention(mx.zeros((1, 4, 64)), cache, cache, [[1]], [3], scale=0.1, backend="reference")


def test_query_offsets_that_do_not_cover_the_queries_are_refused():
    queries, k, v = _tiny_pool()
    with pytest.raises(kernels.InvalidAttentionMetadata, match="query_start_loc"):
        kernels.paged_prefill_attention(queries, k, v, [[1], [2]], [0, 1, 3], [1, 2], scale=0.1, backend="reference")


def test_chunk_longer_than_its_context_is_refused():
    queries, k, v = _tiny_pool()
    with pytest.raises(kernels.InvalidAttentionMetadata, match="more new queries"):
        kernels.paged_prefill_attention(queries, k, v, [[1], [2]], np.array([0, 2, 2]), [1, 2], scale=0.1, backend="reference")
