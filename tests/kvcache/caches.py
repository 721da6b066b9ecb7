"""The kvcache tests' tiny geometry and KV written into a cache's pool as the engine would.

Tiny geometry: 2 layers, 2 KV heads, head_dim 4, block size 4. KV is written straight into the pool
from seeded random numbers, so tests can compare it bit for bit (caches come from conftest's `make_cache`).
"""

import numpy as np

from orchard.kvcache.geometry import KVGeometry

BS = 4


def geometry(dtype="float32", fingerprint="tiny-llama"):
    return KVGeometry(fingerprint, num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype=dtype)


def random_kv(cache, n, seed):
    """K and V for `n` blocks in the pool's storage dtype, never all-zero."""
    rng = np.random.default_rng(seed)
    g = cache.geometry
    shape = (g.num_layers, n, *g.block_shape)
    if g.dtype == "bfloat16":
        return tuple(rng.integers(1, 2**15, size=shape, dtype=np.uint16) for _ in range(2))
    return tuple(rng.standard_normal(shape).astype(g.numpy_storage_dtype) + 3 for _ in range(2))


def prefill(cache, seq_id, tokens, seed):
    """Allocate, write KV for the uncached part, commit: what a prefill step does."""
    reused = cache.allocate(seq_id, tokens)
    table = cache.block_table(seq_id)
    first = reused // BS
    keys, values = random_kv(cache, len(table) - first, seed)
    cache.pool.write_blocks(table[first:], keys, values)
    cache.commit(seq_id, tokens, len(tokens))
    return reused


def kv_of(cache, block_ids):
    return cache.pool.read_blocks(block_ids)


def same_kv(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))
