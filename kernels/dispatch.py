"""The implementation behind a resolved backend (kernels.backends names which one runs).

The decode function of "reference", "metal" or "cuda", the varlen kernels of the compiled
two, and the checks of decode metadata; kernel modules load only when asked for.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels import reference
from kernels.reference import DecodeFn


def decode_function(name: str) -> DecodeFn:
    """The decode implementation of a resolved backend; kernel modules load only when asked for."""
    if name == "metal":
        from kernels import metal

        return metal.paged_decode
    if name == "cuda":
        from kernels import cuda

        return cuda.paged_decode
    return _reference_decode


def varlen_function(name: str):
    """The compiled varlen kernels of "metal" or "cuda": call(queries, key_cache, value_cache, plan, scale, layer)."""
    if name == "metal":
        from kernels import metal

        return metal.paged_varlen
    from kernels import cuda

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
