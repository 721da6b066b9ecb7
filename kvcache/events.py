"""KV events: the only way anything outside a node learns what its pool holds.

Each event carries a per-pool sequence number that never goes back, so a consumer that
sees a gap knows it missed something and must ask for a full snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.hashing import BlockHash

MEMORY = "memory"
DISK = "disk"


@dataclass(frozen=True)
class BlockStored:
    """A block became available as a prefix-cache hit in `tier`."""

    seq: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    tier: str = MEMORY


@dataclass(frozen=True)
class BlockRemoved:
    """A block stopped being available in `tier`."""

    seq: int
    block_hash: BlockHash
    tier: str = MEMORY


KVEvent = BlockStored | BlockRemoved


@dataclass
class EventLog:
    """Events since the last drain, numbered in the order they happened."""

    next_seq: int = 0
    _pending: list[KVEvent] = field(default_factory=list)

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids, tier: str = MEMORY) -> None:
        self._pending.append(BlockStored(self.next_seq, block_hash, parent_hash, tuple(token_ids), tier))
        self.next_seq += 1

    def removed(self, block_hash: BlockHash, tier: str = MEMORY) -> None:
        self._pending.append(BlockRemoved(self.next_seq, block_hash, tier))
        self.next_seq += 1

    def drain(self) -> list[KVEvent]:
        """Hand over everything pending; called by the owner once per engine step."""
        out, self._pending = self._pending, []
        return out
