"""Write new keys and values into one layer's paged pool, in place.

The pool is large and the step's tokens are few, so the write must not copy the pool.
MLX reuses (donates) an input buffer for a scatter's output when nothing else holds
that buffer at evaluation time, so once the caller drops its old reference the scatter
lands in the pool's own memory. Keeping the old array alive forces a copy, which is
correct but costs 2x pool.

A slot is `block_id * block_size + offset`; the scatter indexes the 4-d pool by
(block, offset) directly, and a step splits its slots into those two once (`SlotIndex`)
for every layer, so each layer's write is one scatter per pool and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orchard.kernels.errors import InvalidAttentionMetadata


@dataclass(frozen=True)
class SlotIndex:
    """A step's pool slots as the (block, offset) pairs the scatter indexes by, int32 `[num_tokens]` each."""

    blocks: mx.array
    offsets: mx.array

    @classmethod
    def of(cls, slot_mapping, block_size: int) -> SlotIndex:
        """Split slots on the host when they are there (no device op), else on the device."""
        if isinstance(slot_mapping, mx.array):
            slots = slot_mapping.astype(mx.int32)
            return cls(slots // block_size, slots % block_size)
        slots = np.asarray(slot_mapping, dtype=np.int64)
        return cls(mx.array((slots // block_size).astype(np.int32)), mx.array((slots % block_size).astype(np.int32)))


def write_kv(
    key_cache: mx.array,
    value_cache: mx.array,
    keys: mx.array,
    values: mx.array,
    slot_mapping,
) -> tuple[mx.array, mx.array]:
    """Store token i's K/V at pool slot `slot_mapping[i]` (= block_id * block_size + offset);
    `slot_mapping` may also be a `SlotIndex` made once for a step's layers.

    Returns the updated caches, which are the array objects passed in, updated by item
    assignment (no reshape around the scatter, so no extra primitive per layer); graphs
    built on them earlier still read what they held then.
    """
    _check_shapes(key_cache, value_cache, keys, values)
    index = slot_mapping if isinstance(slot_mapping, SlotIndex) else SlotIndex.of(slot_mapping, key_cache.shape[1])
    if index.blocks.shape != (keys.shape[0],):
        raise InvalidAttentionMetadata(f"slot_mapping must have shape [{keys.shape[0]}], got {index.blocks.shape}")
    return _scatter_rows(key_cache, keys, index), _scatter_rows(value_cache, values, index)


def _scatter_rows(cache: mx.array, rows: mx.array, index: SlotIndex) -> mx.array:
    cache[index.blocks, index.offsets] = rows.astype(cache.dtype)
    return cache


def _check_shapes(key_cache: mx.array, value_cache: mx.array, keys: mx.array, values: mx.array) -> None:
    """The caches share all but their head dim (values may be of another width than keys); each
    new row has its cache's heads and width."""
    if key_cache.ndim != 4 or value_cache.ndim != 4 or key_cache.shape[:3] != value_cache.shape[:3]:
        raise InvalidAttentionMetadata(f"caches must be 4-d and differ only in head dim, got {key_cache.shape} "
                                       f"and {value_cache.shape}")
    if keys.ndim != 3 or keys.shape[1:] != key_cache.shape[2:] or values.shape != (keys.shape[0], *value_cache.shape[2:]):
        raise InvalidAttentionMetadata(
            f"keys must be [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}] and values "
            f"[num_tokens, {value_cache.shape[2]}, {value_cache.shape[3]}], got {keys.shape} and {values.shape}"
        )
