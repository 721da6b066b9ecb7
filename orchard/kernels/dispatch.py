"""The implementation behind a resolved backend (kernels.backends names which one runs).

The decode function of "reference", "metal", "cuda" or "cpu", the varlen functions of the last
three, and the checks of decode metadata; kernel modules load only when asked for.
The GPU kernels keep one head dim for queries, keys, values and outputs; a model whose
values are of another width than its keys (DeepSeek-V2) runs on the reference, chosen once for
the model (`backend_for_head_dims`), and the GPU entries refuse such caches.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from orchard.kernels import reference
from orchard.kernels.backends import HOST_PLANNED, resolve_backend
from orchard.kernels.errors import UnsupportedAttentionShape
from orchard.kernels.reference import DecodeFn

log = logging.getLogger(__name__)


def head_dims_reason(backend: str, key_head_dim: int, value_head_dim: int) -> str | None:
    """Why `backend` cannot attend over keys and values of these head dims, or None."""
    if backend not in HOST_PLANNED and key_head_dim != value_head_dim:
        return (f"the {backend} kernels keep one head dim for keys and values, and these are "
                f"{key_head_dim} and {value_head_dim} wide")
    return None


def backend_for_head_dims(backend: str | None, key_head_dim: int, value_head_dim: int) -> str:
    """The backend a model's layers attend on: `backend` resolved as `resolve_backend` does, or the
    reference where the compiled kernels cannot take the layers' head dims. Ask once per model."""
    name = resolve_backend(backend)
    reason = head_dims_reason(name, key_head_dim, value_head_dim)
    if reason is None:
        return name
    log.info("attention runs on the reference backend: %s", reason)
    return "reference"


def check_head_dims(backend: str, key_cache: mx.array, value_cache: mx.array) -> None:
    """Refuse caches of two head dims on a compiled backend."""
    reason = head_dims_reason(backend, key_cache.shape[-1], value_cache.shape[-1])
    if reason is not None:
        raise UnsupportedAttentionShape(f"{reason}; run such layers on the reference backend")


def decode_function(name: str) -> DecodeFn:
    """The decode implementation of a resolved backend; kernel modules load only when asked for."""
    if name == "metal":
        from orchard.kernels import metal

        return metal.paged_decode
    if name == "cuda":
        from orchard.kernels import cuda

        return cuda.paged_decode
    if name == "cpu":
        from orchard.kernels import cpu

        return cpu.paged_decode
    return _reference_decode


def varlen_function(name: str):
    """The varlen path of "metal", "cuda" or "cpu": call(queries, key_cache, value_cache, plan, scale, layer)."""
    if name == "metal":
        from orchard.kernels import metal

        return metal.paged_varlen
    if name == "cpu":
        from orchard.kernels import cpu

        return cpu.paged_varlen
    from orchard.kernels import cuda

    return cuda.paged_varlen


def _reference_decode(queries, key_cache, value_cache, block_tables, context_lens, scale, layer):
    if isinstance(block_tables, mx.array) and isinstance(context_lens, mx.array):
        return reference.paged_decode_on_device(queries, key_cache, value_cache, block_tables, context_lens, scale, layer)
    return reference.paged_decode_reference(
        queries, key_cache, value_cache,
        reference.as_host_ints(block_tables, "block_tables"),
        reference.as_host_ints(context_lens, "context_lens"),
        scale, layer,
    )


def checked_decode_metadata(queries: mx.array, key_cache: mx.array, block_tables, context_lens):
    """Host metadata is checked value by value; device arrays only by shape, to avoid a sync per step."""
    if isinstance(block_tables, mx.array) and isinstance(context_lens, mx.array):
        reference.check_decode_metadata(
            queries, key_cache,
            np.zeros(block_tables.shape, dtype=np.int32),
            np.ones(context_lens.shape, dtype=np.int32),
        )
        return block_tables, context_lens
    tables = reference.as_host_ints(block_tables, "block_tables")
    lengths = reference.as_host_ints(context_lens, "context_lens")
    reference.check_decode_metadata(queries, key_cache, tables, lengths)
    return tables, lengths
