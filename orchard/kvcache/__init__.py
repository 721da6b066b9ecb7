"""KV memory for paged attention: block pool, block manager, prefix hashes, cold tier, wire format.

`KVCache` is the one object an engine needs. Names that pull in MLX (`KVCache`,
`KVPool`) load on first use, so processes that only hash prompts (the gateway, the
coordinator) never import MLX.
"""

from orchard.kvcache.block_manager import BlockManager, DuplicateSequence
from orchard.kvcache.config import CacheConfig, InvalidCacheConfig
from orchard.kvcache.errors import (
    ColdTierError,
    CorruptKVPayload,
    IncompatibleKVPayload,
    KVCacheError,
    OutOfBlocks,
    OutOfStateSlots,
    QuotaExceeded,
    UnknownSequence,
)
from orchard.kvcache.events import DISK, MEMORY, STATE, BlockRemoved, BlockStored, EventLog, KVEvent
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import BlockHash, block_hashes, hash_block, root_hash
from orchard.kvcache.stats import KVStats, contiguous_waste, paged_waste

_LAZY = {
    "KVCache": "orchard.kvcache.cache",
    "KVPool": "orchard.kvcache.pool",
    "StatePool": "orchard.kvcache.state_pool",
    "MemoryBudget": "orchard.kvcache.budget",
    "ColdTier": "orchard.kvcache.cold_tier",
    "KVBlockData": "orchard.kvcache.wire",
    "encode_blocks": "orchard.kvcache.wire",
    "decode_blocks": "orchard.kvcache.wire",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockHash",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "ColdTierError",
    "CorruptKVPayload",
    "DISK",
    "DuplicateSequence",
    "EventLog",
    "IncompatibleKVPayload",
    "InvalidCacheConfig",
    "KVCacheError",
    "KVEvent",
    "KVGeometry",
    "KVStats",
    "MEMORY",
    "OutOfBlocks",
    "OutOfStateSlots",
    "QuotaExceeded",
    "STATE",
    "UnknownSequence",
    "block_hashes",
    "contiguous_waste",
    "hash_block",
    "paged_waste",
    "root_hash",
    *_LAZY,
]
