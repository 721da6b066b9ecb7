"""KV events: the only way anything outside a node learns what its pool holds.

Each event carries a per-pool sequence number that never goes back, so a consumer that
sees a gap knows it missed something and must ask for a full snapshot.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchard.kvcache.hashing import BlockHash

MEMORY = "memory"
DISK = "disk"
#: Not a place a block's KV lives but what a hybrid model needs beside it: the recurrent state
#: after the block (kvcache.state_snapshots), in memory or on disk. Such a node resumes a
#: prompt only up to a block that has one, so the coordinator counts its runs only that far.
STATE = "state"


#: The events are dataclasses with slots, not frozen: a frozen one's `__init__` sets each field through
#: `object.__setattr__` (0.67 us an event against 0.17 here), and a pull's closing call lists a block an event,
#: 128 for 2,048 tokens of the small demo model (docs/benchmarks.md, "## migration"). Each pickles as its class
#: and its fields (`__reduce__`), as a node and the coordinator do every batch: 128 events in 73 us, and back
#: in 45, against 105 and 81 frozen.


@dataclass(slots=True)
class BlockStored:
    """A block became available as a prefix-cache hit in `tier`."""

    seq: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    tier: str = MEMORY

    def __reduce__(self):
        return BlockStored, (self.seq, self.block_hash, self.parent_hash, self.token_ids, self.tier)

    @classmethod
    def state(cls, seq: int, block_hash: BlockHash) -> BlockStored:
        """The recurrent state after this block became available (a hybrid model's snapshot): the
        block's event in the STATE tier, which holds no tokens of its own."""
        return cls(seq, block_hash, None, (), STATE)


@dataclass(slots=True)
class BlockRemoved:
    """A block stopped being available in `tier`."""

    seq: int
    block_hash: BlockHash
    tier: str = MEMORY

    def __reduce__(self):
        return BlockRemoved, (self.seq, self.block_hash, self.tier)


KVEvent = BlockStored | BlockRemoved


@dataclass(frozen=True)
class PackedEvents:
    """A batch of events pickled once, by the node that sends them. Ray pickles a call's arguments
    with a Python callback per object: 1.7-1.8 ms to send 512 events as a list (a pull of 32 MiB
    of the small demo model makes that many), 0.2 ms as one bytes object, plus ~0.5 ms to pickle
    them here. Node and coordinator run the same code (one Ray cluster), as for any Ray call."""

    data: bytes

    @classmethod
    def of(cls, events: Sequence[KVEvent]) -> PackedEvents:
        return cls(pickle.dumps(list(events), protocol=pickle.HIGHEST_PROTOCOL))

    def unpack(self) -> list[KVEvent]:
        return pickle.loads(self.data)


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

    def state_stored(self, block_hash: BlockHash) -> None:
        self._pending.append(BlockStored.state(self.next_seq, block_hash))
        self.next_seq += 1

    def state_removed(self, block_hash: BlockHash) -> None:
        self.removed(block_hash, STATE)

    def drain(self) -> list[KVEvent]:
        """Hand over everything pending; called by the owner once per engine step."""
        out, self._pending = self._pending, []
        return out
