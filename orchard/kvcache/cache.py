"""KVCache: the one object the engine talks to about KV memory.

It ties the block manager (who holds which block), the pool (the KV bytes), the cold
tier (blocks evicted to disk, and preempted sequences) and the event log together, so
the engine never coordinates them itself. Prefix hits come from memory first, then the
chain continues from the cold tier by copying blocks back into the pool.

Migration (exporting a held prefix run, importing one) is kvcache.block_transfer's, which
KVCache owns and delegates to. One owner thread: the engine loop. Exports and imports for
migration must be called from that thread too (or serialized with it).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import replace

import numpy as np
import xxhash

from orchard.kvcache.block_manager import BlockManager, chain_order
from orchard.kvcache.block_transfer import BlockTransfer
from orchard.kvcache.budget import GIB, MemoryBudget, num_blocks_for
from orchard.kvcache.cold_states import ColdStates, cold_states_path
from orchard.kvcache.cold_tier import ColdTier
from orchard.kvcache.config import CacheConfig, InvalidCacheConfig
from orchard.kvcache.errors import ColdTierError, OutOfBlocks
from orchard.kvcache.events import DISK, BlockStored, EventLog, KVEvent
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.hashing import BlockHash, block_hashes, hash_block, root_hash
from orchard.kvcache.hybrid_states import HybridStates
from orchard.kvcache.pool import KVPool
from orchard.kvcache.state_pool import StatePool
from orchard.kvcache.state_snapshots import StateSnapshots
from orchard.kvcache.stats import KVStats
from orchard.kvcache.wire import KVBlockData, StateSnapshotData
from orchard.kvcache.wire_stream import BlockPieces

log = logging.getLogger(__name__)

_COLD_FAILURES = (ColdTierError, OSError, ValueError)


class KVCache:
    """Paged KV memory of one model: allocation, prefix reuse, spill, swap, migration."""

    def __init__(
        self,
        geometry: KVGeometry,
        config: CacheConfig,
        *,
        budget: MemoryBudget | None = None,
        model_name: str | None = None,
        states: StatePool | None = None,
    ):
        """`states`: a hybrid model's recurrent-state slots, held and freed with each sequence's
        blocks. Its KV alone cannot resume a sequence: a prefix is reused only up to a block
        whose state was snapshotted (`capture_state`, `publish_state`), a block that spills to
        disk takes its snapshot along (kvcache.hybrid_states keeps them), such a cache swaps
        nothing to disk (a preempted sequence is recomputed from its last snapshot), and its
        blocks travel only with the snapshot of the last of them (`export_blocks`, `import_decoded`)."""
        if config.dtype is not None and config.dtype != geometry.dtype:
            raise InvalidCacheConfig("dtype", f"{config.dtype!r} disagrees with the geometry's {geometry.dtype!r}")
        self.geometry = geometry
        self.config = config
        self.block_size = geometry.block_size
        self.root = root_hash(geometry.model_fingerprint, config.cache_salt)
        num_blocks = num_blocks_for(geometry, config, budget=budget, model_name=model_name)
        self._reservation = None
        if budget is not None:
            budget.reserve(model_name, num_blocks * geometry.bytes_per_block)
            self._reservation = (budget, model_name, num_blocks * geometry.bytes_per_block)
        self.pool = KVPool(geometry, num_blocks)
        self.events = EventLog()
        self.hybrid = HybridStates(states, self.events, self.block_size, self.root) if states is not None else None
        self.cold: ColdTier | None = None
        if config.cold_tier_dir is not None:
            cold_bytes = int(config.cold_tier_gb * GIB)
            if self.hybrid is not None:
                cold_bytes -= self.hybrid.open_cold(cold_states_path(config.cold_tier_dir, geometry), cold_bytes)
            self.cold = ColdTier(config.cold_tier_dir, geometry, cold_bytes)
        self.manager = BlockManager(
            num_blocks,
            geometry.block_size,
            self.root,
            watermark=config.watermark,
            events=self.events,
            on_evict=self._spill if self.cold is not None else (self.hybrid.evicted if self.hybrid is not None else None),
            reuse_limit=self.hybrid.usable_blocks if self.hybrid is not None else None,
            prefix_caching=config.enable_prefix_caching,
        )
        self.transfer = BlockTransfer(geometry, self.manager, self.pool, self.root, self.hybrid,
                                      read_cold=self._cold_get, on_disk=self._on_disk)
        self._disk_blocks: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}
        self._swap_keys: set[bytes] = set()
        self._adopt_recovered_cold_blocks()
        self._cold_hits = 0
        self._cold_spills = 0

    # ----------------------------------------------------------------- the engine's calls

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def states(self) -> StatePool | None:
        """A hybrid model's recurrent-state slots; None for a model without state layers."""
        return self.hybrid.states if self.hybrid is not None else None

    @property
    def snapshots(self) -> StateSnapshots | None:
        """A hybrid model's state snapshots in memory, by the block they follow."""
        return self.hybrid.snapshots if self.hybrid is not None else None

    @property
    def cold_states(self) -> ColdStates | None:
        """A hybrid model's state snapshots on disk, beside the cold tier's blocks."""
        return self.hybrid.cold if self.hybrid is not None else None

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` for this model and salt."""
        return block_hashes(token_ids, self.block_size, self.root)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Admission check (memory hits only, watermark kept): cold hits only make it easier."""
        return self.manager.can_allocate(token_ids)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Reserve slots for the prompt; return how many leading tokens already have KV."""
        if self.hybrid is not None:
            return self._allocate_with_state(seq_id, token_ids)
        if self.cold is None:
            return self.manager.allocate(seq_id, token_ids)
        if not self.manager.can_allocate(token_ids, keep_watermark=False):
            raise OutOfBlocks(f"sequence {seq_id!r} does not fit in {self.manager.num_available} available blocks")
        held = self._hold_prefix(token_ids, self.block_hashes(token_ids))
        try:
            return self.manager.allocate(seq_id, token_ids)
        finally:
            self.manager.unpin(held)

    def _allocate_with_state(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """A hybrid model's allocation: the prefix reused up to its last block with a snapshot (in
        memory, or on disk with its blocks), that snapshot restored into a fresh state slot."""
        self.hybrid.check_slot_free(seq_id)
        hashes = self.block_hashes(token_ids)
        held = self._hold_prefix(token_ids, hashes) if self.cold is not None else []
        try:
            # the snapshot of the very run the manager will reuse (the blocks held), which stops short
            # of the last token; with no cold tier there is no snapshot on disk to load
            self.hybrid.load_cold_snapshot(hashes[: len(held)])
            computed = self.manager.allocate(seq_id, token_ids)
        finally:
            self.manager.unpin(held)
        self.hybrid.resume(seq_id, hashes[: computed // self.block_size])
        return computed

    def holds_slots(self, seq_id: Hashable, num_tokens: int) -> bool:
        return self.manager.holds_slots(seq_id, num_tokens)

    def can_append(self, seq_id: Hashable, num_tokens: int) -> bool:
        return self.manager.can_append(seq_id, num_tokens)

    def ensure_slots(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Cover `num_tokens` slots, copying shared blocks the sequence is about to write."""
        copies = self.manager.ensure_slots(seq_id, num_tokens)
        self.pool.copy_blocks(copies)
        return copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        self.manager.commit(seq_id, token_ids, num_computed)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self.manager.fork(parent_id, child_id)
        if self.hybrid is not None:
            self.hybrid.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        self.manager.free(seq_id)
        if self.hybrid is not None:
            self.hybrid.free(seq_id)

    def capture_state(self, seq_id: Hashable, num_computed: int) -> None:
        """Copy the sequence's state as the step just built leaves it, at block boundary `num_computed`;
        it is stored by `publish_state` once the tokens up to there are known."""
        self.hybrid.capture(seq_id, num_computed)

    def publish_state(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Store the sequence's captured state under the hash of the block it ends, if those tokens are known."""
        if self.hybrid is not None:
            self.hybrid.publish(seq_id, token_ids)

    def state_slots(self, seq_ids: Sequence[Hashable]) -> list[int] | None:
        """The sequences' state slots, in order; None for a model without state layers."""
        return self.hybrid.slots(seq_ids) if self.hybrid is not None else None

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.manager.block_table(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        return self.manager.num_computed(seq_id)

    # ----------------------------------------------------------------- preemption

    def swap_out(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> bool:
        """Free a preempted sequence, keeping its computed KV on disk; True if all of it was kept.

        Full blocks go in under their chain hashes (so they are ordinary cold hits later);
        the partly filled last block goes in under a key derived from the sequence id.
        """
        if self.cold is None:
            self.manager.free(seq_id)
            return False
        try:
            self.manager.commit(seq_id, token_ids, max(num_computed, self.manager.num_computed(seq_id)))
            self._write_swap(seq_id, token_ids, self.manager.num_computed(seq_id))
            return True
        except _COLD_FAILURES as err:
            log.warning("swap-out of %r kept nothing on disk: %s", seq_id, err)
            return False
        finally:
            self.manager.free(seq_id)

    def swap_in(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Allocate a swapped-out sequence again; return how many tokens have KV restored."""
        reused = self.allocate(seq_id, token_ids)
        partial = self._take_swapped(seq_id)
        if partial is None or not self._partial_fits(seq_id, token_ids, reused, partial):
            return reused
        table = self.manager.block_table(seq_id)
        target = table[reused // self.block_size]
        self.pool.write_blocks([target], partial.keys[:, None], partial.values[:, None])
        self._cold_hits += 1
        restored = min(reused + len(partial.token_ids), len(token_ids) - 1)
        self.manager.commit(seq_id, token_ids, restored)
        return restored

    def forget_swapped(self, seq_id: Hashable) -> None:
        """Drop the swapped partial block of a sequence that will not come back."""
        self._take_swapped(seq_id)

    # ----------------------------------------------------------------- migration

    def export_blocks(self, hashes: Sequence[BlockHash]) -> bytes:
        """The leading run of `hashes` held here, encoded (kvcache.block_transfer)."""
        return self.transfer.export_blocks(hashes)

    def import_blocks(self, payload: bytes) -> int:
        """Cache the blocks of `payload` not held yet, in chain order; return how many."""
        return self.transfer.import_blocks(payload)

    @property
    def state_geometry(self) -> StateGeometry | None:
        """The state pool's geometry, which a payload's state must have; None for a model without state."""
        return self.transfer.state_geometry

    def import_decoded(self, blocks: Sequence[KVBlockData], state: StateSnapshotData | None = None) -> int:
        """Cache decoded blocks not held yet, in chain order, with a hybrid model's `state` after the last."""
        return self.transfer.import_decoded(blocks, state)

    def reserve_landing(self, parent: BlockHash, wanted: Sequence[BlockHash]):
        """Blocks reserved for a pull's run to land in from another thread, or None (`BlockTransfer`)."""
        return self.transfer.reserve_landing(parent, wanted)

    def pin_export(self, hashes: Sequence[BlockHash]) -> tuple[list[int], list[BlockPieces], StateSnapshotData | None]:
        """Pin the leading run of `hashes` held here as wire pieces, with a hybrid model's snapshot; `unpin_export` when sent."""
        return self.transfer.pin_export(hashes)

    def pin_layer_export(self, hashes: Sequence[BlockHash]):
        """`pin_export` for the layer-major wire format, or None where the run cannot go so (`BlockTransfer`)."""
        return self.transfer.pin_layer_export(hashes)

    def unpin_export(self, pinned: Sequence[int]) -> None:
        self.transfer.unpin_export(pinned)

    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """Start reading, from disk, the blocks of `hashes` that memory does not hold."""
        if self.cold is not None:
            self.cold.prefetch([h for h in hashes if self.manager.cached_block(h) is None])

    # ----------------------------------------------------------------- reporting

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    def snapshot(self) -> list[BlockStored]:
        """All cached blocks, memory then disk, each tier parents first, then the states a resume
        can use (hybrid models), at the next event seq."""
        seq = self.events.next_seq
        disk = {h: parent for h, (parent, _) in self._disk_blocks.items()}
        on_disk = [BlockStored(seq, h, disk[h], self._disk_blocks[h][1], DISK) for h in chain_order(disk)]
        return self.manager.snapshot() + on_disk + (self.hybrid.held_events(seq) if self.hybrid is not None else [])

    def stats(self) -> KVStats:
        return replace(self.manager.stats(), cold_tier_hits=self._cold_hits, cold_tier_spills=self._cold_spills)

    def close(self) -> None:
        """Release the cold tier file and this pool's share of the memory budget."""
        if self.cold is not None:
            self.cold.close()
            self.cold = None
            self.manager.on_evict = None
        if self.hybrid is not None:
            self.hybrid.close()
        if self._reservation is not None:
            budget, model_name, nbytes = self._reservation
            budget.release(model_name, nbytes)
            self._reservation = None

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _adopt_recovered_cold_blocks(self) -> None:
        """Announce the blocks a reopened cold-tier file still holds (and the state snapshots after
        them, for a hybrid model); drop stale swap blocks and snapshots whose block is gone.

        Only blocks whose key is the chained hash of their parent and full token list are
        prefix blocks; anything else is a partial block a previous process swapped out for
        a sequence that no longer exists.
        """
        if self.cold is None:
            return
        for key, parent, tokens in self.cold.entries():
            if parent is not None and len(tokens) == self.block_size and hash_block(parent, tokens) == key:
                self._disk_blocks[key] = (parent, tuple(tokens))
                self.events.stored(key, parent, tokens, DISK)
            else:
                self.cold.discard(key)
        if self.hybrid is not None:
            self.hybrid.adopt_recovered(self._disk_blocks)

    def _hold_prefix(self, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> list[int]:
        """Pin the longest reusable prefix (`hashes`: its blocks' hashes), restoring from disk what
        memory lacks."""
        hashes = hashes[: self.manager.max_reusable_blocks(len(token_ids))]
        held: list[int] = []
        restored: list[tuple[int, KVBlockData]] = []
        try:
            parent = self.root
            for index, block_hash in enumerate(hashes):
                pinned = self.manager.pin([block_hash])
                if not pinned:
                    tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
                    pinned = self._import_from_cold(block_hash, parent, tokens, restored)
                if not pinned:
                    break
                held.extend(pinned)
                parent = block_hash
            if restored:
                self.pool.write_blocks([b for b, _ in restored], *_stacked([d for _, d in restored]))
                self._cold_hits += len(restored)
        except BaseException:
            self.manager.unpin(held)
            raise
        return held

    def _import_from_cold(self, block_hash, parent, tokens, restored: list) -> list[int]:
        data = self._cold_get(block_hash)
        if data is None or tuple(data.token_ids) != tokens:
            return []
        if self.manager.import_cached(block_hash, parent, tokens) is None:
            return []
        pinned = self.manager.pin([block_hash])
        restored.append((pinned[0], data))
        return pinned

    def _on_disk(self, key: bytes) -> bool:
        return self.cold is not None and key in self.cold

    def _cold_get(self, key: bytes) -> KVBlockData | None:
        if not self._on_disk(key):
            return None
        data = self.cold.get(key)
        if data is None:  # failed its checksum; the tier dropped it
            self._forget_on_disk([key])
        return data

    def _spill(self, block_id: int, block_hash: BlockHash, parent_hash, token_ids) -> None:
        """Eviction hook: copy a cached block to disk before its memory is reused."""
        try:
            if block_hash not in self.cold:
                keys, values = self.pool.read_blocks([block_id])
                self._put_block(block_hash, keys[:, 0], values[:, 0], token_ids, parent_hash)
        except _COLD_FAILURES as err:
            log.warning("could not spill block %s to the cold tier: %s", block_hash.hex(), err)
        if self.hybrid is not None:
            try:
                self.hybrid.spill(block_hash, block_hash in self.cold)  # asked after the put, which may have failed
            except _COLD_FAILURES as err:
                log.warning("could not spill the state snapshot of block %s: %s", block_hash.hex(), err)

    def _put_block(self, block_hash: BlockHash, keys, values, token_ids, parent_hash) -> None:
        dropped = self.cold.put(block_hash, keys, values, tuple(token_ids), parent_hash)
        self._cold_spills += 1
        self._disk_blocks[block_hash] = (parent_hash, tuple(token_ids))
        self.events.stored(block_hash, parent_hash, token_ids, DISK)
        self._forget_on_disk(dropped)

    def _forget_on_disk(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self._swap_keys:
                self._swap_keys.discard(key)
            else:
                self._disk_blocks.pop(key, None)
                self.events.removed(key, DISK)
                if self.hybrid is not None:
                    self.hybrid.left_disk(key)

    def _swap_key(self, seq_id: Hashable) -> bytes:
        return xxhash.xxh3_128_digest(b"swap:" + self.root + repr(seq_id).encode())

    def _write_swap(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        bs = self.block_size
        table = self.manager.block_table(seq_id)
        hashes = self.manager.sequence_hashes(seq_id)
        full = num_computed // bs
        missing = [i for i in range(full) if hashes[i] not in self.cold]
        has_partial = num_computed % bs != 0
        if not missing and not has_partial:
            return
        keys, values = self.pool.read_blocks([table[i] for i in missing] + ([table[full]] if has_partial else []))
        for j, i in enumerate(missing):
            parent = hashes[i - 1] if i else self.root
            self._put_block(hashes[i], keys[:, j], values[:, j], token_ids[i * bs : (i + 1) * bs], parent)
        if has_partial:
            key = self._swap_key(seq_id)
            parent = hashes[full - 1] if full else self.root
            self._forget_on_disk(self.cold.put(key, keys[:, -1], values[:, -1], token_ids[full * bs : num_computed], parent))
            self._swap_keys.add(key)

    def _take_swapped(self, seq_id: Hashable) -> KVBlockData | None:
        key = self._swap_key(seq_id)
        if self.cold is None or key not in self._swap_keys:
            return None
        self._swap_keys.discard(key)
        data = self.cold.get(key)
        self.cold.discard(key)
        return data

    def _partial_fits(self, seq_id, token_ids, reused: int, partial: KVBlockData) -> bool:
        """The swapped partial block continues exactly the chain that was just restored."""
        full = reused // self.block_size
        parent = self.manager.sequence_hashes(seq_id)[full - 1] if full else self.root
        tokens = tuple(token_ids[reused : reused + len(partial.token_ids)])
        return partial.parent_hash == parent and tuple(partial.token_ids) == tokens


def _stacked(blocks: Sequence[KVBlockData]) -> tuple[np.ndarray, np.ndarray]:
    """K and V of single blocks stacked into the pool's `[layers, n, ...]` layout."""
    return np.stack([b.keys for b in blocks], axis=1), np.stack([b.values for b in blocks], axis=1)
