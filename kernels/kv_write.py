"""Write new keys and values into one layer's paged pool, in place.

The pool is large and the step's tokens are few, so the write must not copy the pool.
MLX reuses (donates) an input buffer for a scatter's output when nothing else holds
that buffer at evaluation time; flattening to `[num_blocks * block_size, H, D]` is a
view, so once the caller drops its old reference the scatter lands in the pool's own
memory. Keeping the old array alive forces a copy, which is correct but costs 2x pool.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.errors import InvalidAttentionMetadata


def write_kv(
    key_cache: mx.array,
    value_cache: mx.array,
    keys: mx.array,
    values: mx.array,
    slot_mapping,
) -> tuple[mx.array, mx.array]:
    """Store token i's K/V at pool slot `slot_mapping[i]` (= block_id * block_size + offset).

    Returns the updated caches; the caller must replace its references with them.
    """
    _check_shapes(key_cache, value_cache, keys, values)
    slots = slot_mapping if isinstance(slot_mapping, mx.array) else mx.array(slot_mapping, dtype=mx.int32)
    if slots.shape != (keys.shape[0],):
        raise InvalidAttentionMetadata(f"slot_mapping must have shape [{keys.shape[0]}], got {slots.shape}")
    return _scatter_rows(key_cache, keys, slots), _scatter_rows(value_cache, values, slots)


def _scatter_rows(cache: mx.array, rows: mx.array, slots: mx.array) -> mx.array:
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    del cache  # our own reference must not pin the buffer when the scatter is evaluated
    flat[slots] = rows.astype(flat.dtype)
    return flat.reshape(num_blocks, block_size, num_kv_heads, head_dim)


def _check_shapes(key_cache: mx.array, value_cache: mx.array, keys: mx.array, values: mx.array) -> None:
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4:
        raise InvalidAttentionMetadata(f"caches must share one 4-d shape, got {key_cache.shape} and {value_cache.shape}")
    if keys.shape != values.shape or keys.ndim != 3 or keys.shape[1:] != key_cache.shape[2:]:
        raise InvalidAttentionMetadata(
            f"keys/values must be [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}], "
            f"got {keys.shape} and {values.shape}"
        )
