"""A pull's blocks landed straight in the pool off the engine thread, then cached by the engine.

Imported chunk by chunk on the engine thread, a pull into a node that is decoding waits for the step in
progress at every chunk, and each import's copy takes time from the steps (docs/benchmarks.md, "Pulls
into a node that is decoding": the large demo model's 1.5-2.6x slower at the median than landed, the
small one's faster over Ray). Here the engine thread reserves the run's blocks once, before the first chunk
is taken (`BlockTransfer.reserve_landing`); another thread checks each chunk and writes its KV into the
next reserved blocks through the pool's layer views: the direct path's receive thread reads it there from
the socket (`placing`), or its landing thread copies a chunk that had to land in a buffer first (`land`);
and the engine lists what landed as cached once, when the reply has ended (`adopt`), or as it
lands and then once more (`adopt_landed`, then `adopt`): on its own thread, or on a thread it is lent
to while it idles (`orchard.node.command_queue`), never on both at once.

A run pulled over several connections lands in parts (`parts`): each part's blocks in order, by its own
thread, the parts at once; what counts as landed is the run's leading blocks with none missing between.

Reserved blocks belong to no sequence and hold no hash, so no step reads or writes them and no prefix
lookup finds them before `adopt`; whatever did not land goes back to the free queue there. The block
before the run, where this pool holds it, is held meanwhile, so reserving cannot evict the parent the
run hangs from.

The views alias the pool's buffers (`KVPool.layer_views`): a step writes its own blocks in place and
leaves the reserved ones alone. Were a step ever to copy a layer instead (MLX could not write it in
place), writes through the old views would be lost, so `adopt` compares each buffer's address with the
one taken at reservation and caches nothing where one moved (`PoolMoved`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from orchard.kvcache.block_manager import BlockManager
from orchard.kvcache.errors import IncompatibleKVPayload, PoolMoved
from orchard.kvcache.hashing import HASH_SIZE, BlockHash, hash_block_rows
from orchard.kvcache.pool import KVPool, as_slice
from orchard.kvcache.wire import BlockRun, KVBlockData, row_bytes, wire_dtype

_FREE, _WRITING, _WRITTEN = range(3)  # a reserved block's state in its landing


class BlockLanding:
    """The reserved blocks of one pull, filled in order by `land` (any one thread), cached by `adopt`
    (the engine's turn, once)."""

    def __init__(self, manager: BlockManager, pool: KVPool, views, wanted: Sequence[BlockHash], block_ids: list[int],
                 held_parent: list[int], chains: Callable[[BlockHash], bool]):
        """`views`: the pool's layer views (`KVPool.layer_views`); `wanted`: the run asked for, in order;
        `block_ids`: the blocks reserved for its leading blocks (fewer where the pool had fewer spare);
        `held_parent`: the pinned block before the run, if any; `chains(parent)`: whether a block with
        that parent is reachable here."""
        self.manager, self.pool, self.block_ids = manager, pool, block_ids
        self._wanted = b"".join(bytes(h) for h in wanted[: len(block_ids)])
        self._held_parent, self._chains = held_parent, chains
        self._views, self._addresses = views, pool.buffer_addresses()  # the views' buffers, read off the same arrays
        n = len(block_ids)
        self._hashes: list[bytes | None] = [None] * n  # of each block landed, by its place in the run
        self._parents: list[bytes | None] = [None] * n
        self._tokens: list[tuple[int, ...] | None] = [None] * n
        self._states = [_FREE] * n  # each reserved block's: free, being written, written whole
        self.landed = 0  # leading blocks of the run written into their reserved blocks, none missing between
        self._listed = 0  # leading blocks of the run listed as cached (`adopt_landed`, `adopt`)
        self._unreachable = False  # the run's first block hangs from nothing here: none of it is listed
        self._done = False  # adopted or released: no block of it may be written any more
        self._writing = 0  # chunks being written now
        self._lock = threading.Condition()  # a chunk lands whole before its blocks can be adopted or freed

    @property
    def capacity(self) -> int:
        """Blocks this landing can take: those reserved."""
        return len(self.block_ids)

    def parts(self, sizes: Sequence[int]) -> list[LandingPart]:
        """The run's consecutive parts of `sizes` blocks (their sum at most `capacity`), each to land on a
        thread of its own, in order within it, while the others land."""
        if sum(sizes) > self.capacity or min(sizes, default=1) < 1:
            raise ValueError(f"parts of {list(sizes)} blocks in a landing of {self.capacity}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [LandingPart(self, start, size) for start, size in zip(starts, sizes)]

    # ----------------------------------------------------------------- landing thread

    def land(self, blocks: Sequence[KVBlockData]) -> int:
        """Check a chunk (the run's next blocks, in order, each hash following from its parent and
        tokens) and write its KV into their reserved blocks; returns how many landed. Raises
        `IncompatibleKVPayload`, writing nothing, for a chunk that is not the run's next blocks."""
        return _land(self.placing, blocks)

    @property
    def places_wire_bytes(self) -> bool:
        """Whether KV bytes as the wire lays them out (`orchard.kvcache.wire.wire_dtype`) may be written into
        `placing`'s blocks as they are: the pool keeps them in the same little-endian dtype."""
        return self._views[0][0].dtype.str == wire_dtype(self.pool.geometry).str

    @contextmanager
    def placing(self, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray,
                at: int | None = None) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
        """Where the run's next blocks go, checked as `land` checks them (`hashes`, `parents` `[n, 16]` uint8,
        `tokens` `[n, block_size]`): per layer, views of their reserved blocks' K and V, in the run's order,
        each `[k, block_size, heads, head dim]`: one view of all n where the blocks reserved are consecutive,
        else one a block. The
        caller writes every layer; the blocks count as landed only if its body returns, so a chunk whose bytes
        turn out damaged part way leaves them reserved, never cached. `adopt` and `release` wait for a chunk
        being written; the landing's lock is not held meanwhile, so other parts' chunks are written at once.
        `at`: the run's place of the first block (a part's, `LandingPart`), else the first not landed."""
        if hash_block_rows(parents, tokens) != hashes.tobytes():
            raise IncompatibleKVPayload("a block's hash does not match its parent and tokens")
        listing = _Listing.of(hashes, parents, tokens)  # made now, while the KV is still on its way
        with self._lock:
            start = self.landed if at is None else at
            rows = self._claim(start, hashes, parents, tokens)
            self._writing += 1
        try:
            yield [([keys[r] for r in rows], [values[r] for r in rows]) for keys, values in zip(*self._views)]
            with self._lock:
                self._filled_in(start, listing)
        except BaseException:
            with self._lock:
                self._states[start : start + len(hashes)] = [_FREE] * len(hashes)
            raise
        finally:
            with self._lock:
                self._writing -= 1
                self._lock.notify_all()

    def _filled_in(self, start: int, listing: _Listing) -> None:
        """Blocks `[start, start + n)` were written whole: keep what lists them, move `landed` past them where
        the run's blocks before are written too (under the lock)."""
        end = start + len(listing.hashes)
        self._hashes[start:end], self._parents[start:end], self._tokens[start:end] = listing
        self._states[start:end] = [_WRITTEN] * len(listing.hashes)
        while self.landed < self.capacity and self._states[self.landed] == _WRITTEN:
            self.landed += 1

    def _claim(self, start: int, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> list[slice]:
        """The reserved blocks of the run's `len(hashes)` blocks from `start` (whose hashes follow from their
        parents and tokens), once they are checked to be those and marked as being written, as slices of the pool's blocks: one where they are consecutive,
        else one a block (under the lock)."""
        if self._done:
            raise IncompatibleKVPayload("a chunk arrived after its pull ended")
        n = len(hashes)
        if start + n > self.capacity or hashes.tobytes() != self._wanted[start * HASH_SIZE : (start + n) * HASH_SIZE]:
            raise IncompatibleKVPayload("a chunk of the reply is not the next blocks of the run asked for")
        if any(state != _FREE for state in self._states[start : start + n]):
            raise IncompatibleKVPayload("a chunk of the reply repeats blocks already landed")
        if start and parents[0].tobytes() != self._wanted[(start - 1) * HASH_SIZE : start * HASH_SIZE]:
            raise IncompatibleKVPayload("a chunk of the reply does not follow the block before it")
        self._states[start : start + n] = [_WRITING] * n
        rows = as_slice(self.block_ids[start : start + n])
        return [rows] if isinstance(rows, slice) else [slice(b, b + 1) for b in rows.tolist()]

    # ----------------------------------------------------------------- the engine's turn (its thread or a loan)

    def adopt_landed(self) -> int:
        """List the blocks landed since the last call as cached, the landing going on; returns how many
        were listed. Listing costs a few microseconds a block: called as each chunk lands (between two
        steps of an engine that is stepping), it does most of that while the next chunks arrive, and leaves
        little for `adopt`, which would wait for the step in progress. Raises
        `PoolMoved`, caching nothing more, where a pool buffer moved since the blocks were reserved."""
        with self._lock:
            if self._done:
                raise RuntimeError("a landing adopted whole lists nothing more")
            landed = self.landed
        return self._list(landed)

    def adopt(self) -> int:
        """List the landed blocks not listed yet as cached (those not cached here meanwhile) and free
        every other reserved block; returns how many were listed. Once only. Raises `PoolMoved`,
        caching nothing more, where a pool buffer moved while blocks landed in it."""
        self._end("a landing is adopted once")
        try:
            return self._list(self.landed)
        finally:
            self.manager.unpin(list(reversed(self.block_ids)))  # the chain's head ends most recent
            self.manager.unpin(self._held_parent)

    def _end(self, again: str | None) -> bool:
        """Take no chunk more, once every chunk being written has landed or failed; False where it had ended
        already (raises RuntimeError(`again`) instead, where given)."""
        with self._lock:
            if self._done:
                if again is not None:
                    raise RuntimeError(again)
                return False
            self._done = True
            self._lock.wait_for(lambda: self._writing == 0)
        return True

    def _list(self, landed: int) -> int:
        """List blocks `[listed, landed)` of the run (the engine's turn); the run's first block is listed only
        where its parent is reachable here, and nothing after a first that was not."""
        start = self._listed
        if landed == start or self._unreachable:
            return 0
        if self.pool.buffer_addresses() != self._addresses:
            raise PoolMoved("the KV pool's buffers moved while a pull's blocks landed in them")
        if start == 0 and self.manager.cached_block(self._hashes[0]) is None and not self._chains(self._parents[0]):
            self._unreachable = True
            return 0
        part = slice(start, landed)
        listed = self.manager.adopt(self.block_ids[part], self._hashes[part], self._parents[part], self._tokens[part])
        self._listed = landed
        return len(listed)

    def release(self) -> None:
        """Free every reserved block, caching none (a pull that never asked); a landing adopted does nothing."""
        if not self._end(None):
            return
        self.manager.unpin(self.block_ids)
        self.manager.unpin(self._held_parent)


class LandingPart:
    """Consecutive blocks of a landing's run (`BlockLanding.parts`), landed in order by one thread as the
    landing's other parts land on theirs: `land` and `placing` as the landing's, from the part's start."""

    def __init__(self, landing: BlockLanding, start: int, size: int):
        self.landing, self.start, self.capacity = landing, start, size
        self.landed = 0  # the part's leading blocks written

    @property
    def places_wire_bytes(self) -> bool:
        return self.landing.places_wire_bytes

    def land(self, blocks: Sequence[KVBlockData]) -> int:
        """`BlockLanding.land`, of the part's next blocks."""
        return _land(self.placing, blocks)

    @contextmanager
    def placing(self, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
        """`BlockLanding.placing` of the part's next blocks; refused (`IncompatibleKVPayload`) past its end."""
        if self.landed + len(hashes) > self.capacity:
            raise IncompatibleKVPayload("a chunk of the reply runs past the blocks its connection asked for")
        with self.landing.placing(hashes, parents, tokens, at=self.start + self.landed) as layers:
            yield layers
        self.landed += len(hashes)


class _Listing(NamedTuple):
    """What lists a chunk's blocks once written, as the block manager keeps it, made apart from the chunk's
    buffer (reused once handed back)."""

    hashes: list[bytes]
    parents: list[bytes]
    tokens: list[tuple[int, ...]]

    @classmethod
    def of(cls, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> _Listing:
        return cls(row_bytes(hashes), row_bytes(parents), list(map(tuple, tokens.tolist())))


def _land(placing, blocks: Sequence[KVBlockData]) -> int:
    """`BlockLanding.land` through `placing` (a landing's or a part's)."""
    if not isinstance(blocks, BlockRun):  # a version 2 payload read block by block
        if any(b.parent_hash is None for b in blocks):
            raise IncompatibleKVPayload("a migrated block has no parent")
        blocks = BlockRun.of(blocks)
    if len(blocks) == 0:
        return 0
    with placing(blocks.hashes, blocks.parents, blocks.tokens) as layers:
        for layer, (key_rows, value_rows) in enumerate(layers):
            _write(key_rows, blocks.keys[:, layer])
            _write(value_rows, blocks.values[:, layer])
    return len(blocks)


def _write(rows: list[np.ndarray], blocks: np.ndarray) -> None:
    """Copy `blocks` (`[n, ...]`) into `placing`'s views of their rows, in order."""
    at = 0
    for row in rows:
        row[...] = blocks[at : at + len(row)]
        at += len(row)

