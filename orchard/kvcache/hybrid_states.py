"""The recurrent-state side of a hybrid model's KV cache: slots, snapshots, and where a resume can stop.

A hybrid model (Gated DeltaNet + full attention) cannot resume a sequence from KV alone: each
sequence also holds a slot of the state pool (kvcache.state_pool), and a cached prefix is
usable only up to a block whose state was snapshotted (kvcache.state_snapshots). This module
keeps those snapshots in step with the blocks they follow: it stores them when the engine
captures and publishes them, drops them when their block is evicted, sends them to disk when
their block spills there (kvcache.cold_states, which gets `COLD_STATE_SHARE` of the cold
tier's bytes), brings them back for a resume, and tells the coordinator which blocks a resume
can use here (block events in the STATE tier), so it counts a hybrid node's runs only that far.

KVCache owns one of these per hybrid model and calls it from its own block operations (its
migration, kvcache.block_transfer, too); nothing here touches blocks. One owner thread: the
engine loop.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchard.kvcache.cold_states import ColdStates
from orchard.kvcache.errors import IncompatibleKVPayload, OutOfStateSlots
from orchard.kvcache.events import BlockStored, EventLog
from orchard.kvcache.geometry import StateGeometry
from orchard.kvcache.hashing import BlockHash, block_hashes
from orchard.kvcache.state_snapshots import StateSnapshots
from orchard.kvcache.wire import KVBlockData, StateSnapshotData

if TYPE_CHECKING:
    from orchard.kvcache.state_pool import StatePool

#: The share of the cold tier's bytes a hybrid model gives its state snapshots (kvcache.cold_states),
#: the rest going to its blocks: a block on disk is worth keeping only up to a snapshot, and a
#: snapshot only with its blocks, so neither kind may crowd the other out.
COLD_STATE_SHARE = 0.5


class HybridStates:
    """A hybrid model's state slots and snapshots, in memory and on disk, by the block they follow."""

    def __init__(self, states: StatePool, events: EventLog, block_size: int, root: BlockHash):
        """`events`: the cache's log, where the blocks a resume can use are announced; `block_size`
        and `root` hash a published sequence's tokens as the cache hashes its blocks."""
        self.states = states
        self.events = events
        self.block_size = block_size
        self.root = root
        self.snapshots = StateSnapshots(capacity=states.num_slots)
        self.cold: ColdStates | None = None
        self._pending: dict[Hashable, tuple[int, list]] = {}
        self._announced: set[BlockHash] = set()  # snapshots the coordinator was told of

    def open_cold(self, path: Path, cold_bytes: int) -> int:
        """Open the snapshots' file with `COLD_STATE_SHARE` of the cold tier's bytes; returns the bytes it took."""
        state_bytes = int(cold_bytes * COLD_STATE_SHARE)
        slots = max(1, state_bytes // max(self.states.geometry.nbytes, 1))
        self.cold = ColdStates(path, self.states.geometry, slots)
        return state_bytes

    @property
    def geometry(self) -> StateGeometry:
        return self.states.geometry

    # ----------------------------------------------------------------- sequences

    def check_slot_free(self, seq_id: Hashable) -> None:
        """Refuse a sequence before it takes any block, when no state slot is left for it."""
        if self.states.num_free == 0:
            raise OutOfStateSlots(f"sequence {seq_id!r}: every state slot is held")

    def resume(self, seq_id: Hashable, reused: Sequence[BlockHash]) -> None:
        """Give the sequence a slot holding the state after its `reused` blocks (zero when none);
        the cache reuses blocks only up to one with a snapshot (`usable_blocks`)."""
        self.states.allocate(seq_id)
        if reused:
            self.states.restore(seq_id, self.snapshots.take(reused[-1]))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self.states.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        self.states.free(seq_id)
        self._pending.pop(seq_id, None)

    def slots(self, seq_ids: Sequence[Hashable]) -> list[int]:
        return [self.states.slot(s) for s in seq_ids]

    def capture(self, seq_id: Hashable, num_computed: int) -> None:
        """Copy the sequence's state at block boundary `num_computed`, to `publish` once its tokens are known."""
        if num_computed % self.block_size:
            raise ValueError(f"a state snapshot sits at a block boundary, not at token {num_computed}")
        self._pending[seq_id] = (num_computed, self.states.snapshot(seq_id))

    def publish(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Store the captured state under the hash of the block it ends, if those tokens are known."""
        pending = self._pending.pop(seq_id, None)
        if pending is not None and pending[0] <= len(token_ids):
            boundary, snapshot = pending
            block_hash = block_hashes(token_ids[:boundary], self.block_size, self.root)[-1]
            self._announce([block_hash, *self.snapshots.put(block_hash, snapshot)])

    # ----------------------------------------------------------------- where a resume can stop

    def usable_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of these leading cached blocks a resume can use: up to the last with a snapshot
        in memory or on disk (the block manager's reuse limit)."""
        for count in range(len(hashes), 0, -1):
            if self._held(hashes[count - 1]):
                return count
        return 0

    def load_cold_snapshot(self, hashes: Sequence[BlockHash]) -> None:
        """Bring the snapshot a resume along `hashes` would use into memory when it is only on disk
        (one that fails its checksum is dropped there, and the resume stops at an earlier one)."""
        while self.cold is not None and (usable := self.usable_blocks(hashes)):
            last = hashes[usable - 1]
            if last in self.snapshots:
                return
            arrays = self.cold.get(last)
            if arrays is not None:
                self._announce(self.snapshots.put(last, self.states.device_copy(arrays)))
                return
            self._announce([last])  # failed its checksum: dropped

    def _held(self, block_hash: BlockHash) -> bool:
        return block_hash in self.snapshots or (self.cold is not None and block_hash in self.cold)

    def _announce(self, hashes: Sequence[BlockHash]) -> None:
        """One event per change in whether a resume can use a block here (a snapshot held in memory
        or on disk), so the coordinator counts a hybrid node's runs only as far as they resume."""
        for block_hash in hashes:
            held = self._held(block_hash)
            if held and block_hash not in self._announced:
                self._announced.add(block_hash)
                self.events.state_stored(block_hash)
            elif not held and block_hash in self._announced:
                self._announced.discard(block_hash)
                self.events.state_removed(block_hash)

    def held_events(self, seq: int) -> list[BlockStored]:
        """The blocks a resume can use here, as STATE-tier events at `seq` (the cache's snapshot of itself)."""
        return [BlockStored.state(seq, h) for h in self._announced]

    # ----------------------------------------------------------------- blocks leaving or coming back

    def evicted(self, block_id: int, block_hash: BlockHash, parent_hash, token_ids) -> None:
        """The block manager's eviction hook without a cold tier: a snapshot dies with its block."""
        self.snapshots.drop(block_hash)
        self._announce([block_hash])

    def spill(self, block_hash: BlockHash, block_on_disk: bool) -> None:
        """A block leaving memory takes its snapshot (if it has one in memory) to disk, where it is
        kept only beside its block: without it, nothing could resume from it."""
        if self.cold is None or block_hash not in self.snapshots:
            return
        snapshot = self.snapshots.get(block_hash)
        self.snapshots.drop(block_hash)
        dropped = []
        try:
            if block_on_disk and block_hash not in self.cold:  # one read back from disk is there still
                dropped = self.cold.put(block_hash, self.states.host_copy(snapshot))
        finally:
            self._announce([block_hash, *dropped])

    def left_disk(self, block_hash: BlockHash) -> None:
        """A block the cold tier no longer holds: its snapshot on disk can no longer be resumed from."""
        if self.cold is not None:
            self.cold.discard(block_hash)
            self._announce([block_hash])

    def adopt_recovered(self, disk_blocks: Collection[BlockHash]) -> None:
        """Keep the snapshots a reopened file holds after `disk_blocks` (the blocks the cold tier
        still holds), drop the rest, and announce what a resume can use."""
        if self.cold is None:
            return
        for key in self.cold.keys():
            if key not in disk_blocks:
                self.cold.discard(key)  # its block did not survive: nothing to resume after
        self._announce(self.cold.keys())

    def close(self) -> None:
        if self.cold is not None:
            self.cold.close()
            self.cold = None

    # ----------------------------------------------------------------- migration

    def sendable_blocks(self, held: Sequence[BlockHash]) -> int:
        """How many of these leading blocks held in memory are worth sending: up to the last with a
        snapshot in memory (KV past it cannot be resumed from without a state)."""
        return self.snapshots.usable_blocks(held)

    def state_after(self, blocks: Sequence) -> StateSnapshotData | None:
        """The snapshot after the last of the exported `blocks`, to send with them."""
        if not blocks:
            return None
        last = blocks[-1].block_hash
        return StateSnapshotData(last, self.states.geometry, self.states.host_copy(self.snapshots.get(last)))

    def keep(self, state: StateSnapshotData) -> None:
        """Store an imported snapshot under its block, which the caller holds in memory; the block's
        eviction drops it as any other."""
        dropped = self.snapshots.put(state.block_hash, self.states.device_copy(state.arrays))
        self._announce([state.block_hash, *dropped])


def check_state_fits(geometry: StateGeometry | None, blocks: Sequence[KVBlockData], state: StateSnapshotData | None) -> None:
    """A model with state pool `geometry` imports blocks only with the state after the last of them;
    a model without one (None) takes no state. Anything else could resume from a wrong state."""
    if geometry is None:
        if state is not None:
            raise IncompatibleKVPayload("KV payload carries a recurrent state, and this model keeps none")
        return
    if not blocks:
        if state is not None:
            raise IncompatibleKVPayload("KV payload carries a recurrent state without the block it follows")
        return
    if state is None:
        raise IncompatibleKVPayload("KV payload has no recurrent state: a hybrid model cannot resume from its blocks alone")
    if state.block_hash != blocks[-1].block_hash:
        raise IncompatibleKVPayload(f"KV payload's state belongs to block {state.block_hash.hex()}, "
                                    f"not to its last block {blocks[-1].block_hash.hex()}")
    mismatch = geometry.mismatch(state.geometry)
    if mismatch is not None:
        raise IncompatibleKVPayload(f"KV payload's recurrent state is for another state pool: {mismatch}")
