"""How a node's KV cache is sized and where its cold tier lives, checked once on creation."""

from __future__ import annotations

from dataclasses import dataclass

from orchard.kvcache.geometry import DTYPE_SIZES


class InvalidCacheConfig(ValueError):
    """A cache setting is out of range; `.field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class CacheConfig:
    """KV cache settings.

    Size the pool with `num_blocks` or `kv_memory_gb` (not both); with neither, it takes
    `memory_fraction` of the memory left free once the model is loaded. `dtype=None`
    follows the model. The cold tier is off unless `cold_tier_dir` is set.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    memory_fraction: float = 0.5
    watermark: float = 0.01
    dtype: str | None = None
    cold_tier_dir: str | None = None
    cold_tier_gb: float = 4.0
    cache_salt: str | None = None
    enable_prefix_caching: bool = True  # False: every prompt is computed afresh, no block is reused

    def __post_init__(self):
        checks = [
            ("block_size", self.block_size >= 1, "must be at least 1"),
            ("num_blocks", self.num_blocks is None or self.num_blocks >= 2, "must be at least 2 (block 0 is reserved)"),
            ("kv_memory_gb", self.kv_memory_gb is None or self.kv_memory_gb > 0, "must be positive"),
            ("kv_memory_gb", self.num_blocks is None or self.kv_memory_gb is None, "set num_blocks or kv_memory_gb, not both"),
            ("memory_fraction", 0.0 < self.memory_fraction <= 1.0, "must be in (0, 1]"),
            ("watermark", 0.0 <= self.watermark < 1.0, "must be in [0, 1)"),
            ("dtype", self.dtype is None or self.dtype in DTYPE_SIZES, f"must be one of {sorted(DTYPE_SIZES)}"),
            ("cold_tier_gb", self.cold_tier_gb > 0, "must be positive"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidCacheConfig(name, why)
