"""Cached blocks leaving for another node and arriving from one (KV migration).

An export is the leading run of a chain that this cache holds, memory first and then the
cold tier, pinned while it is read so eviction cannot reuse a block mid-send; for a hybrid
model the run stops at its last block with a state snapshot, which travels with it (KV past
that block cannot be resumed from). An import caches only blocks whose hash follows from
their parent and tokens and whose parent is reachable here, so a wrong or orphaned block
can never become a prefix hit.

KVCache owns one of these and delegates its migration calls to it; the block manager, the
pool and the hybrid states are KVCache's, shared, and the cold tier is reached through
KVCache's callables because KVCache alone keeps its bookkeeping (and may close it). One
owner thread: the engine loop (a `BlockLanding` it reserves is written from the direct path's
landing thread, in the reserved blocks alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from orchard.kvcache.block_landing import BlockLanding
from orchard.kvcache.block_manager import BlockManager
from orchard.kvcache.errors import IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.hashing import BlockHash, hash_block, hash_block_rows
from orchard.kvcache.hybrid_states import HybridStates, check_state_fits
from orchard.kvcache.pool import KVPool, as_slice
from orchard.kvcache.wire import (
    BlockRun,
    KVBlockData,
    StateSnapshotData,
    decode_payload,
    encode_blocks,
    hash_rows,
    token_rows,
)
from orchard.kvcache.wire_layers import LayerChunk
from orchard.kvcache.wire_stream import BlockPieces


class BlockTransfer:
    """Encodes a held prefix run for sending and caches one received, with a hybrid model's state."""

    def __init__(
        self,
        geometry: KVGeometry,
        manager: BlockManager,
        pool: KVPool,
        root: BlockHash,
        hybrid: HybridStates | None,
        *,
        read_cold: Callable[[BlockHash], KVBlockData | None],
        on_disk: Callable[[BlockHash], bool],
    ):
        """`read_cold`: a block from the cold tier, or None where it holds none (or lost it);
        `on_disk`: whether the cold tier holds a key, which lets an import chain onto a block on disk."""
        self.geometry = geometry
        self.manager = manager
        self.pool = pool
        self.root = root
        self.hybrid = hybrid
        self._read_cold = read_cold
        self._on_disk = on_disk

    @property
    def state_geometry(self) -> StateGeometry | None:
        """The state pool's geometry, which a payload's state must have; None for a model without state."""
        return self.hybrid.geometry if self.hybrid is not None else None

    # ----------------------------------------------------------------- leaving

    def export_blocks(self, hashes: Sequence[BlockHash]) -> bytes:
        """Encode the leading blocks of `hashes` held in memory or on disk (a prefix run); for a
        hybrid model, up to the last of them with a state snapshot, and that snapshot."""
        hashes = self._exportable(hashes)
        pinned = self.manager.pin(hashes)
        try:
            blocks = self._memory_blocks(pinned) + self._cold_run(hashes[len(pinned) :])
            return encode_blocks(self.geometry, blocks, self._state_after(blocks))
        finally:
            self.manager.unpin(pinned)

    def pin_export(self, hashes: Sequence[BlockHash]) -> tuple[list[int], list[BlockPieces], StateSnapshotData | None]:
        """Pin the leading run of `hashes` held here (memory, then disk; for a hybrid model up to
        the last block with a state snapshot) and describe it as wire pieces that point into the
        pool's arrays where it can, with that snapshot; `unpin_export` when sent."""
        hashes = self._exportable(hashes)
        pinned = self.manager.pin(hashes)
        views = self.pool.layer_views()
        blocks = [_pieces(b) for b in self._memory_blocks(pinned)] if views is None else self._view_pieces(pinned, views)
        blocks += [_pieces(b) for b in self._cold_run(hashes[len(pinned) :])]
        return pinned, blocks, self._state_after(blocks)

    def pin_layer_export(self, hashes: Sequence[BlockHash]) -> tuple[list[int], LayerRun] | None:
        """`pin_export` for the layer-major wire format (`orchard.kvcache.wire_layers`): the leading run of
        `hashes` held in memory, pinned, with the pool's layers to slice it from; None (nothing pinned)
        where it cannot be sent so: a hybrid model, a pool numpy cannot view, a run that goes on to disk."""
        views = self.pool.layer_views() if self.hybrid is None else None
        if views is None:
            return None
        pinned = self.manager.pin(hashes)
        if not pinned or len(pinned) < len(hashes) and self._on_disk(hashes[len(pinned)]):
            self.manager.unpin(pinned)
            return None
        records = [self.manager.block(block_id) for block_id in pinned]
        return pinned, LayerRun([(b.block_hash, b.parent_hash, b.token_ids) for b in records], pinned, views)

    def unpin_export(self, pinned: Sequence[int]) -> None:
        """Let eviction have the blocks `pin_export` held, once their pieces are sent."""
        self.manager.unpin(pinned)

    # ----------------------------------------------------------------- arriving

    def import_blocks(self, payload: bytes) -> int:
        """Cache the blocks of `payload` not held yet, in chain order; return how many."""
        decoded = decode_payload(payload, self.geometry, self.state_geometry)
        return self.import_decoded(decoded.blocks, decoded.state)

    def import_decoded(self, blocks: Sequence[KVBlockData], state: StateSnapshotData | None = None) -> int:
        """Cache decoded blocks (`decode_payload`, `decode_payload_views`) not held yet, in chain
        order; a hybrid model's `state` (the snapshot after the last block) is stored with them."""
        check_state_fits(self.state_geometry, blocks, state)
        # The run's blocks already here are held meanwhile: a free block taken for a later one
        # would otherwise evict one of them and leave what follows unreachable.
        hashes = blocks.hash_list() if isinstance(blocks, BlockRun) else [b.block_hash for b in blocks]
        held = self.manager.hold_cached(hashes)
        try:
            return self._import_blocks(blocks, hashes, state)
        finally:
            self.manager.unpin(held)

    def _import_blocks(self, blocks: Sequence[KVBlockData], hashes: list[BlockHash], state: StateSnapshotData | None) -> int:
        if isinstance(blocks, BlockRun) and len(blocks) and blocks.is_chained():
            return self._import_run(blocks, hashes, state)
        for block in blocks:
            if not _hash_checks_out(block):
                raise IncompatibleKVPayload(f"block {block.block_hash.hex()}: hash does not match its parent and tokens")
        pinned: list[int] = []
        try:
            written = self._take_blocks(blocks, pinned)
            if written:
                self.pool.write_block_arrays(pinned, [b.keys for b in written], [b.values for b in written])
            self._keep_state(state)
            return len(written)
        finally:
            self.manager.unpin(list(reversed(pinned)))  # the chain's head ends most recent

    def _import_run(self, run: BlockRun, hashes: list[BlockHash], state: StateSnapshotData | None) -> int:
        """`import_decoded` of a chained run read at once (`hashes`: its hash column as a list): the same
        checks and the same blocks taken, with a numpy pass or one call per chunk where the loop above
        spends one per block."""
        parents = run.parent_list()
        if hash_block_rows(run.parents, run.tokens) != run.hashes.tobytes():
            raise IncompatibleKVPayload(f"block {_first_wrong_hash(run).hex()}: hash does not match its parent and tokens")
        if self.manager.cached_block(hashes[0]) is None and not self._chains_here(parents[0]):
            return 0  # past the first block, each parent is the block before it: held, or taken here
        taken, block_ids = self.manager.import_run(hashes, parents, [tuple(t) for t in run.tokens.tolist()])
        try:
            if taken:
                rows = as_slice(taken)
                self.pool.write_block_arrays(block_ids, run.keys[rows], run.values[rows])
            self._keep_state(state)
            return len(taken)
        finally:
            self.manager.unpin(list(reversed(block_ids)))  # the chain's head ends most recent

    def reserve_landing(self, parent: BlockHash, wanted: Sequence[BlockHash]) -> BlockLanding | None:
        """Free blocks reserved for the leading blocks of `wanted` (the run after `parent`, which this
        cache holds or is the root), for another thread to land them in (`orchard.kvcache.block_landing`);
        None where blocks cannot land so: a hybrid model (its state travels with the run), a pool numpy
        cannot view, no free block."""
        views = self.pool.layer_views() if self.hybrid is None and wanted else None
        if views is None:
            return None
        held_parent = self.manager.pin([parent]) if parent != self.root else []
        block_ids = self.manager.reserve(len(wanted))
        if not block_ids:
            self.manager.unpin(held_parent)
            return None
        return BlockLanding(self.manager, self.pool, views, wanted, block_ids, held_parent, self._chains_here)

    def _keep_state(self, state: StateSnapshotData | None) -> None:
        if state is not None and self.manager.cached_block(state.block_hash) is not None:
            self.hybrid.keep(state)  # the run may have stopped short of its block (a full pool, a broken chain)

    # ----------------------------------------------------------------- internals

    def _take_blocks(self, blocks: Sequence[KVBlockData], pinned: list[int]) -> list[KVBlockData]:
        """List as cached, and pin into `pinned`, the blocks not held yet up to the first that
        cannot be taken (no parent here, not full, no free block); returns those blocks. The
        caller unpins `pinned` even when this raises part way."""
        written: list[KVBlockData] = []
        for block in blocks:
            if self.manager.cached_block(block.block_hash) is not None:
                continue
            if not self._chains_here(block.parent_hash) or len(block.token_ids) != self.geometry.block_size:
                break
            if self.manager.import_cached(block.block_hash, block.parent_hash, block.token_ids) is None:
                break
            pinned.extend(self.manager.pin([block.block_hash]))
            written.append(block)
        return written

    def _exportable(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The leading hashes worth sending: all of them, or for a hybrid model the held run up to
        its last block with a state snapshot (KV past it cannot be resumed from without a state)."""
        if self.hybrid is None:
            return hashes
        held = 0
        while held < len(hashes) and self.manager.cached_block(hashes[held]) is not None:
            held += 1
        return hashes[: self.hybrid.sendable_blocks(hashes[:held])]

    def _cold_run(self, hashes: Sequence[BlockHash]) -> list[KVBlockData]:
        """The leading blocks of `hashes` the cold tier holds, continuing a run memory ended."""
        blocks = []
        for block_hash in hashes:
            data = self._read_cold(block_hash)
            if data is None:
                break
            blocks.append(data)
        return blocks

    def _state_after(self, blocks) -> StateSnapshotData | None:
        """The state snapshot after the last of the exported `blocks`, for a hybrid model."""
        return self.hybrid.state_after(blocks) if self.hybrid is not None else None

    def _chains_here(self, parent: BlockHash | None) -> bool:
        """Whether a block with this parent is reachable from our root."""
        if parent == self.root:
            return True
        return self.manager.cached_block(parent) is not None or self._on_disk(parent)

    def _view_pieces(self, block_ids: list[int], views) -> list[BlockPieces]:
        """Pinned blocks as pieces that are slices of the pool's arrays, so sending copies nothing
        (slices of one byte view per layer: a numpy view per block and layer costs three times as much)."""
        key_layers, value_layers = ([memoryview(layer).cast("B") for layer in part] for part in views)
        kb, vb = self.geometry.key_bytes_per_block_layer, self.geometry.value_bytes_per_block_layer
        out = []
        for block_id in block_ids:
            block = self.manager.block(block_id)
            k, v = block_id * kb, block_id * vb
            out.append(BlockPieces(block.block_hash, block.parent_hash, block.token_ids,
                                   [layer[k : k + kb] for layer in key_layers], [layer[v : v + vb] for layer in value_layers]))
        return out

    def _memory_blocks(self, block_ids: list[int]) -> list[KVBlockData]:
        """Pinned blocks read out of the pool (one copy for all of them), with their chain records."""
        if not block_ids:
            return []
        keys, values = self.pool.read_blocks(block_ids)
        out = []
        for j, block_id in enumerate(block_ids):
            block = self.manager.block(block_id)
            out.append(KVBlockData(block.block_hash, block.parent_hash, block.token_ids, keys[:, j], values[:, j]))
        return out


class LayerRun:
    """A pinned run to send layer-major, cut into chunks on the link's thread: a chunk whose block
    ids are consecutive (a fresh pool hands them out so) is one slice of each layer's K and V, no
    copy; any other is gathered, one copy per layer. A chunk's hash, parent and token rows are made
    there too, from each block's (hash, parent, tokens) as it was pinned (a pinned block keeps them):
    the engine thread only pins, and the first chunk, which waits for it, waits less."""

    def __init__(self, blocks: list[tuple[BlockHash, BlockHash, tuple[int, ...]]], block_ids: list[int], views):
        self.blocks, self.block_ids = blocks, block_ids
        self.key_layers, self.value_layers = views

    def __len__(self) -> int:
        return len(self.block_ids)

    def chunk(self, start: int, stop: int) -> LayerChunk:
        rows, blocks = as_slice(self.block_ids[start:stop]), self.blocks[start:stop]
        return LayerChunk(hash_rows(h for h, _, _ in blocks), hash_rows(p for _, p, _ in blocks),
                          token_rows(t for _, _, t in blocks),
                          [layer[rows] for layer in self.key_layers], [layer[rows] for layer in self.value_layers])


def _pieces(block: KVBlockData) -> BlockPieces:
    return BlockPieces(block.block_hash, block.parent_hash, block.token_ids, list(block.keys), list(block.values))


def _first_wrong_hash(run: BlockRun) -> bytes:
    return next(b.block_hash for b in run if not _hash_checks_out(b))


def _hash_checks_out(block: KVBlockData) -> bool:
    """A payload's hashes must follow from its tokens, or a wrong block could become a hit."""
    return block.parent_hash is not None and hash_block(block.parent_hash, block.token_ids) == block.block_hash
