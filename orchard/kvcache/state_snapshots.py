"""Recurrent states saved at block boundaries, so a hybrid model's prefix can be resumed.

A Gated DeltaNet state is a fold over the whole prefix: it cannot be cut out of a longer one,
so KV blocks alone cannot resume a hybrid sequence mid-conversation. While sequences run, the
engine saves a copy of the state slot at some block-aligned positions (prefill chunk ends,
which the scheduler aligns to `interval`, the prompt's last full block, and the last boundary a
finished sequence passed); each is keyed by the chained hash of the block that ends there. A
new prompt resumes at the longest run of cached blocks whose last hash has a snapshot
(`usable_blocks`): KV from the pool up to there, the state from the snapshot.

A snapshot is useless without its blocks: the block manager's eviction drops it (`drop`), or
with a cold tier spills it to disk beside them (kvcache.cold_states); the store keeps at most
`capacity` snapshots in memory, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from orchard.kvcache.hashing import BlockHash


class StateSnapshots:
    """Snapshots of recurrent states by block hash: `[state layer][kind]` arrays of one sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_hash: OrderedDict[BlockHash, list] = OrderedDict()
        self.restored = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def hashes(self) -> list[BlockHash]:
        """The blocks that have a snapshot, least recently used first."""
        return list(self._by_hash)

    def put(self, block_hash: BlockHash, snapshot: list) -> list[BlockHash]:
        """Store a snapshot; returns the hashes whose snapshots it pushed out (least recent first)."""
        self._by_hash[block_hash] = snapshot
        self._by_hash.move_to_end(block_hash)
        dropped = []
        while len(self._by_hash) > self.capacity:
            dropped.append(self._by_hash.popitem(last=False)[0])
        return dropped

    def take(self, block_hash: BlockHash) -> list:
        """The snapshot to restore (it stays stored, now the most recently used)."""
        self._by_hash.move_to_end(block_hash)
        self.restored += 1
        return self._by_hash[block_hash]

    def get(self, block_hash: BlockHash) -> list:
        """The snapshot to send elsewhere (not a restore here; it becomes the most recently used)."""
        self._by_hash.move_to_end(block_hash)
        return self._by_hash[block_hash]

    def drop(self, block_hash: BlockHash) -> None:
        self._by_hash.pop(block_hash, None)

    def usable_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of these leading cached blocks a resume can use: up to the last with a snapshot."""
        for count in range(len(hashes), 0, -1):
            if hashes[count - 1] in self._by_hash:
                return count
        return 0
