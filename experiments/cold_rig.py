"""A KVCache with a cold tier, holding known prefixes on disk only: the set-up that the
cold-restore and prefetch experiments share.

Everything goes through the facade the engine uses (`KVCache.allocate` restores a
prefix from the cold tier into the pool; `KVCache.prefetch` issues MADV_WILLNEED), so the
timings include the hashing, bookkeeping and pool writes a real restore pays.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from experiments.common import drop_file_cache
from orchard.kvcache import CacheConfig, KVCache
from orchard.kvcache.geometry import KVGeometry


@dataclass
class Prefix:
    tokens: list[int]
    keys: np.ndarray  # [layers, blocks, block, heads, dim] in storage dtype
    values: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]


def random_prefix(geometry: KVGeometry, num_tokens: int, seed: int) -> Prefix:
    """A prefix of whole blocks with random KV bytes (restore time does not depend on the values)."""
    rng = np.random.default_rng(seed)
    n_blocks = num_tokens // geometry.block_size
    shape = (geometry.num_layers, n_blocks, *geometry.block_shape)
    dtype = geometry.numpy_storage_dtype
    if dtype == np.uint16:
        keys, values = rng.integers(0, 1 << 16, size=(2, *shape), dtype=np.uint16)
    else:
        keys, values = rng.standard_normal((2, *shape)).astype(dtype)
    tokens = rng.integers(1, 30000, size=n_blocks * geometry.block_size).tolist()
    return Prefix(tokens, keys, values)


@dataclass
class ColdRig:
    """One KVCache whose prefixes have all been evicted to its cold tier."""

    geometry: KVGeometry
    prefixes: list[Prefix]
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="uma-kv-exp-")))
    kv: KVCache = field(init=False)

    def __post_init__(self):
        largest = max(p.num_blocks for p in self.prefixes)
        total = sum(p.num_blocks for p in self.prefixes)
        stride = self.geometry.bytes_per_block + 4096
        config = CacheConfig(block_size=self.geometry.block_size, num_blocks=largest + 3, watermark=0.0,
                             cold_tier_dir=str(self.directory), cold_tier_gb=(total + 4) * stride / 2**30)
        self.kv = KVCache(self.geometry, config)
        for i, prefix in enumerate(self.prefixes):
            self._compute(f"seed-{i}", prefix)
        self.evict_all()

    def _compute(self, seq_id: str, prefix: Prefix) -> None:
        """Stand-in for a prefill: allocate, write the prefix's KV, commit, free (it stays cached)."""
        self.kv.allocate(seq_id, prefix.tokens + [0])
        table = self.kv.block_table(seq_id)[: prefix.num_blocks]
        self.kv.pool.write_blocks(table, prefix.keys, prefix.values)
        self.kv.commit(seq_id, prefix.tokens + [0], len(prefix.tokens))
        self.kv.free(seq_id)

    def evict_all(self) -> None:
        """Claim every pool block with a throwaway sequence, so cached blocks go to disk."""
        filler = list(range(10**8, 10**8 + (self.kv.num_blocks - 1) * self.geometry.block_size))
        self.kv.allocate("filler", filler)
        self.kv.free("filler")

    def drop_page_cache(self) -> int | None:
        """Evict the cold file from the OS page cache (our own mapping included); bytes still resident."""
        tier = self.kv.cold
        return drop_file_cache(tier.path, tier._mm)  # no public hook on ColdTier for this yet

    def restore(self, index: int, seq_id: str = "restore") -> int:
        """Bring prefix `index` back into the pool the way admission does; returns tokens reused."""
        prefix = self.prefixes[index]
        reused = self.kv.allocate(seq_id, prefix.tokens + [0])
        self.kv.free(seq_id)
        return reused

    def prefetch(self, index: int) -> None:
        self.kv.prefetch(self.kv.block_hashes(self.prefixes[index].tokens))

    def check_exact(self, index: int) -> bool:
        """Restore prefix `index` and compare the pool's bytes with what was written."""
        prefix = self.prefixes[index]
        self.kv.allocate("check", prefix.tokens + [0])
        table = self.kv.block_table("check")[: prefix.num_blocks]
        keys, values = self.kv.pool.read_blocks(table)
        self.kv.free("check")
        return keys.tobytes() == prefix.keys.tobytes() and values.tobytes() == prefix.values.tobytes()

    def close(self) -> None:
        import shutil

        self.kv.close()
        shutil.rmtree(self.directory, ignore_errors=True)
