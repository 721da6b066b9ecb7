"""The kvcache tests' `make_cache` fixture: KVCaches of the tiny geometry (`tests.kvcache.caches`)."""

import pytest

from orchard.kvcache.cache import KVCache
from orchard.kvcache.config import CacheConfig
from tests.kvcache.caches import BS, geometry


@pytest.fixture
def make_cache(tmp_path):
    made = []

    def make(num_blocks=10, cold=False, dtype="float32", salt=None, fingerprint="tiny-llama", cold_dir=None,
             cold_bytes=1 << 20):
        config = CacheConfig(
            block_size=BS,
            num_blocks=num_blocks,
            watermark=0.0,
            cache_salt=salt,
            cold_tier_dir=str(cold_dir or tmp_path / f"cold{len(made)}") if cold else None,
            cold_tier_gb=cold_bytes / (1 << 30),
        )
        cache = KVCache(geometry(dtype, fingerprint), config)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        assert cache.manager.num_used == 0, "a test leaked blocks"
        cache.close()
