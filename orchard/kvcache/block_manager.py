"""Which KV block holds what: ref counts, the prefix-cache map and the LRU free queue.

Pure bookkeeping with no MLX: the engine asks it every step for every sequence, so each
operation costs O(blocks it touches). Every `can_*` only looks; the matching action
checks the same condition first and raises `OutOfBlocks` before changing anything, so
callers never need rollback code.

Block 0 is the null block that padded block-table entries point at: never handed out.
A block with ref count 0 sits in the free queue whether or not it still holds a cached
prefix; taking one that does evicts it (event, `on_evict` hook, counter) just before
it is reused, which is what lets the facade spill it to the cold tier in time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from orchard.kvcache.errors import KVCacheError, OutOfBlocks, UnknownSequence
from orchard.kvcache.events import MEMORY, BlockStored, EventLog
from orchard.kvcache.hashing import BlockHash, hash_block
from orchard.kvcache.stats import KVStats

#: Called with (block_id, block_hash, parent_hash, token_ids) while the block's KV is intact.
EvictHook = Callable[[int, BlockHash, "BlockHash | None", tuple[int, ...]], None]

NULL_BLOCK = 0


class DuplicateSequence(KVCacheError):
    """A sequence id that the block manager already holds."""


@dataclass(slots=True)
class Block:
    """One physical block. `filled` counts slots holding KV (for fragmentation)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    filled: int = 0


@dataclass(slots=True)
class _Sequence:
    block_ids: list[int]
    num_computed: int
    #: chain hashes of the sequence's computed full blocks, whether or not each block
    #: itself is the registered holder of that hash (a duplicate stays unhashed).
    hashes: list[BlockHash] = field(default_factory=list)


class BlockManager:
    """Ref-counted blocks shared through chained prefix hashes, evicted least recently used."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        root: BlockHash,
        *,
        watermark: float = 0.01,
        events: EventLog | None = None,
        on_evict: EvictHook | None = None,
        reuse_limit: Callable[[list[BlockHash]], int] | None = None,
        prefix_caching: bool = True,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.root = root
        self.events = events if events is not None else EventLog()
        self.on_evict = on_evict
        # How many leading cached blocks a new sequence may reuse, given their hashes; all by default.
        # A hybrid model resumes only where a recurrent-state snapshot exists (kvcache.state_snapshots).
        self.reuse_limit = reuse_limit
        self.prefix_caching = prefix_caching
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Ref-0 blocks, least recently used first. An OrderedDict because eviction and
        # prefix hits remove from the middle, and both must stay O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK + 1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._num_free_cached = 0  # ref-0 blocks that still hold a hash
        self._used_kv_slots = 0  # KV-holding slots of blocks with ref > 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0

    # ----------------------------------------------------------------- counts

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return len(self._blocks)

    @property
    def num_usable(self) -> int:
        return len(self._blocks) - 1

    @property
    def num_used(self) -> int:
        """Blocks referenced by a sequence or a pin."""
        return self.num_usable - len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a prefix (evictable cache hits)."""
        return self._num_free_cached

    @property
    def num_free(self) -> int:
        """Unreferenced blocks holding nothing worth keeping."""
        return len(self._free) - self._num_free_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable cached."""
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    # ----------------------------------------------------------------- lookups

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest run of leading full blocks cached in memory."""
        return self._prefix_hits(token_ids, len(token_ids) // self.block_size)[0]

    def max_reusable_blocks(self, num_tokens: int) -> int:
        """Full blocks strictly before the last token: one token is always left to compute
        (none at all with prefix caching off)."""
        if not self.prefix_caching:
            return 0
        return max(num_tokens - 1, 0) // self.block_size

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def block(self, block_id: int) -> Block:
        """The block record (read it, do not change it)."""
        return self._blocks[block_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def num_computed(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_computed

    def sequence_hashes(self, seq_id: Hashable) -> list[BlockHash]:
        """Chain hashes of the sequence's committed full blocks, in order."""
        return list(self._seq(seq_id).hashes)

    # ----------------------------------------------------------------- admission

    def can_allocate(self, token_ids: Sequence[int], *, keep_watermark: bool = True) -> bool:
        """Whether `allocate` would succeed, leaving the watermark in reserve when asked."""
        hits, _ = self._prefix_hits(token_ids, self.max_reusable_blocks(len(token_ids)))
        spare = self._available_besides(hits) - (self.blocks_for(len(token_ids)) - len(hits))
        return spare >= (self.watermark_blocks if keep_watermark else 0)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Reserve blocks for every slot of `token_ids`; return how many tokens were reused."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("cannot allocate an empty sequence")
        hits, hashes = self._prefix_hits(token_ids, self.max_reusable_blocks(len(token_ids)))
        needed = self.blocks_for(len(token_ids)) - len(hits)
        if needed > self._available_besides(hits):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {needed} new blocks, {self._available_besides(hits)} available")
        for block_id in hits:
            self._acquire(self._blocks[block_id])
        block_ids = hits + [self._claim().block_id for _ in range(needed)]
        reused = len(hits) * self.block_size
        self._seqs[seq_id] = _Sequence(block_ids, reused, hashes)
        self._query_tokens += len(token_ids)
        self._hit_tokens += reused
        return reused

    # ----------------------------------------------------------------- growth

    def holds_slots(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether the sequence's own blocks already cover `num_tokens` slots, none of the ones
        still to be written shared: then growing to `num_tokens` needs no block and no copy,
        which is a decode step's case fifteen times in sixteen."""
        seq = self._seq(seq_id)
        bs = self.block_size
        if num_tokens > len(seq.block_ids) * bs:
            return False
        if num_tokens <= seq.num_computed:
            return True
        blocks = self._blocks
        return all(blocks[seq.block_ids[i]].ref_count == 1 for i in range(seq.num_computed // bs, -(-num_tokens // bs)))

    def can_append(self, seq_id: Hashable, num_tokens: int) -> bool:
        new_blocks, shared = self._growth_plan(self._seq(seq_id), num_tokens)
        return new_blocks + len(shared) <= len(self._free)

    def ensure_slots(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Cover `num_tokens` slots; return the (src, dst) block copies copy-on-write needs.

        A block about to be written while another sequence shares it (after `fork`) is
        replaced by a fresh one; only blocks already holding computed KV need a copy.
        """
        seq = self._seq(seq_id)
        new_blocks, shared = self._growth_plan(seq, num_tokens)
        if new_blocks + len(shared) > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {new_blocks + len(shared)} blocks, {len(self._free)} available")
        copies = [pair for index in shared if (pair := self._copy_on_write(seq, index))]
        seq.block_ids.extend(self._claim().block_id for _ in range(new_blocks))
        return copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first `num_computed` slots hold KV; cache blocks that became full."""
        seq = self._seq(seq_id)
        capacity = len(seq.block_ids) * self.block_size
        if not seq.num_computed <= num_computed <= min(capacity, len(token_ids)):
            raise ValueError(
                f"num_computed {num_computed} outside [{seq.num_computed}, {min(capacity, len(token_ids))}]"
                f" for sequence {seq_id!r}"
            )
        self._mark_filled(seq, num_computed)
        seq.num_computed = num_computed
        for index in range(len(seq.hashes), num_computed // self.block_size):
            self._commit_full_block(seq, index, token_ids)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give `child_id` every block of `parent_id`, shared until one of them writes."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(f"sequence {child_id!r} already has blocks")
        for block_id in parent.block_ids:
            self._acquire(self._blocks[block_id])
        self._seqs[child_id] = _Sequence(list(parent.block_ids), parent.num_computed, list(parent.hashes))

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its last blocks are released first so they are evicted first."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(f"sequence {seq_id!r} is not held")
        for block_id in reversed(seq.block_ids):
            self._release(self._blocks[block_id])

    # ----------------------------------------------------------------- outside traffic

    def pin(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the leading cached blocks of `hashes` (ref +1) so eviction cannot take them."""
        pinned = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            self._acquire(self._blocks[block_id])
            pinned.append(block_id)
        return pinned

    def hold_cached(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold (ref +1) every block of `hashes` cached here, wherever it stands in the run, so that
        taking free blocks for the rest of the run cannot evict them; `unpin` the ids returned."""
        held = [self._cached[h] for h in hashes if h in self._cached]
        for block_id in held:
            self._acquire(self._blocks[block_id])
        return held

    def unpin(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if self._blocks[block_id].ref_count == 0:
                raise ValueError(f"block {block_id} is not pinned")
            self._release(self._blocks[block_id])

    def import_cached(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> int | None:
        """Take a block for KV arriving from elsewhere and list it as cached (ref 0, most recent).

        The caller writes the KV into the returned block before anything else can take it.
        """
        self._check_full(token_ids)
        if block_hash in self._cached or not self._free:
            return None
        block = self._take_imported(block_hash, parent_hash, tuple(token_ids))
        self._park(block)
        return block.block_id

    def import_run(
        self, hashes: Sequence[BlockHash], parents: Sequence[BlockHash], token_ids: Sequence[tuple[int, ...]]
    ) -> tuple[list[int], list[int]]:
        """`import_cached` and `pin` for each block of a run in one call: take a block for each hash
        not cached yet, in order, until none is free; list it as cached, held (ref 1) so that the
        caller can write its KV. Returns the run's indexes taken and their block ids; `unpin` them
        once written. One call a chunk instead of two a block: a pull imports thousands."""
        taken: list[int] = []
        block_ids: list[int] = []
        for i, block_hash in enumerate(hashes):
            if block_hash in self._cached:
                continue
            if not self._free:
                break
            self._check_full(token_ids[i])
            block = self._take_imported(block_hash, parents[i], token_ids[i])
            block.ref_count = 1
            self._used_kv_slots += block.filled
            taken.append(i)
            block_ids.append(block.block_id)
        return taken, block_ids

    def reserve(self, count: int) -> list[int]:
        """Take up to `count` free blocks for KV that will land in them from elsewhere, leaving the
        watermark free for the running sequences' growth (so fewer where fewer are spare): held (ref 1),
        holding no hash, so no sequence and no prefix lookup reaches them. `adopt` lists them as cached
        once their KV is written; `unpin` every one of them then."""
        spare = max(0, len(self._free) - self.watermark_blocks)
        return [self._claim().block_id for _ in range(min(count, spare))]

    def adopt(
        self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parents: Sequence[BlockHash],
        token_ids: Sequence[tuple[int, ...]],
    ) -> list[int]:
        """List reserved blocks as cached, block i under `hashes[i]`, their KV now written; a hash
        cached meanwhile keeps its block and leaves the reserved one uncached. Returns the ids listed.
        The caller still unpins every reserved block."""
        adopted = []
        for block_id, block_hash, parent, tokens in zip(block_ids, hashes, parents, token_ids, strict=True):
            block = self._blocks[block_id]
            if block_hash in self._cached or block.block_hash is not None or block.ref_count != 1:
                continue
            self._check_full(tokens)
            self._list_full(block, block_hash, parent, tuple(tokens))
            self._used_kv_slots += block.filled  # held: its slots count as used
            adopted.append(block_id)
        return adopted

    def snapshot(self) -> list[BlockStored]:
        """Every cached block, parents before children, numbered with the next event seq.

        A consumer that applies the snapshot ignores events numbered below that seq.
        """
        seq = self.events.next_seq
        parents = {h: self._blocks[b].parent_hash for h, b in self._cached.items()}
        return [
            BlockStored(seq, h, parents[h], self._blocks[self._cached[h]].token_ids, MEMORY)
            for h in chain_order(parents)
        ]

    def stats(self) -> KVStats:
        return KVStats(
            blocks_total=self.num_usable,
            blocks_used=self.num_used,
            blocks_cached=self.num_cached,
            blocks_free=self.num_free,
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            allocated_slots=self.num_used * self.block_size,
            kv_slots=self._used_kv_slots,
        )

    # ----------------------------------------------------------------- internals

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} is not held") from None

    def _prefix_hits(self, token_ids: Sequence[int], limit: int) -> tuple[list[int], list[BlockHash]]:
        """Cached block ids and their hashes for up to `limit` leading full blocks (as many as `reuse_limit` allows)."""
        hits, hashes = self._cached_run(token_ids, limit)
        if self.reuse_limit is not None:
            usable = self.reuse_limit(hashes)
            hits, hashes = hits[:usable], hashes[:usable]
        return hits, hashes

    def _cached_run(self, token_ids: Sequence[int], limit: int) -> tuple[list[int], list[BlockHash]]:
        bs = self.block_size
        hits: list[int] = []
        hashes: list[BlockHash] = []
        parent = self.root
        for index in range(limit):
            parent = hash_block(parent, token_ids[index * bs : (index + 1) * bs])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(parent)
        return hits, hashes

    def _available_besides(self, hits: list[int]) -> int:
        """Free-queue blocks left once the prefix hits among them are taken out."""
        return len(self._free) - sum(1 for block_id in hits if self._blocks[block_id].ref_count == 0)

    def _growth_plan(self, seq: _Sequence, num_tokens: int) -> tuple[int, list[int]]:
        """New blocks to append, and table indexes of shared blocks that will be written."""
        target = self.blocks_for(num_tokens)
        new_blocks = max(target - len(seq.block_ids), 0)
        if num_tokens <= seq.num_computed:
            return new_blocks, []
        first = seq.num_computed // self.block_size
        last = min(target, len(seq.block_ids))
        shared = [i for i in range(first, last) if self._blocks[seq.block_ids[i]].ref_count > 1]
        return new_blocks, shared

    def _copy_on_write(self, seq: _Sequence, index: int) -> tuple[int, int] | None:
        old = self._blocks[seq.block_ids[index]]
        new = self._claim()
        seq.block_ids[index] = new.block_id
        computed_here = min(self.block_size, seq.num_computed - index * self.block_size)
        self._release(old)
        if computed_here <= 0:
            return None
        new.filled = computed_here
        self._used_kv_slots += computed_here
        return old.block_id, new.block_id

    def _mark_filled(self, seq: _Sequence, num_computed: int) -> None:
        bs = self.block_size
        for index in range(seq.num_computed // bs, self.blocks_for(num_computed)):
            block = self._blocks[seq.block_ids[index]]
            filled = min(bs, num_computed - index * bs)
            if filled > block.filled:
                self._used_kv_slots += filled - block.filled
                block.filled = filled

    def _commit_full_block(self, seq: _Sequence, index: int, token_ids: Sequence[int]) -> None:
        bs = self.block_size
        parent = seq.hashes[-1] if seq.hashes else self.root
        tokens = tuple(token_ids[index * bs : (index + 1) * bs])
        block_hash = hash_block(parent, tokens)
        seq.hashes.append(block_hash)
        block = self._blocks[seq.block_ids[index]]
        if block.block_hash is None and block_hash not in self._cached:
            self._register(block, block_hash, parent, tokens)

    def _register(self, block: Block, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple) -> None:
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
        self._cached[block_hash] = block.block_id
        self.events.stored(block_hash, parent, tokens, MEMORY)

    def _acquire(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
            if block.block_hash is not None:
                self._num_free_cached -= 1
            self._used_kv_slots += block.filled
        block.ref_count += 1

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self._used_kv_slots -= block.filled
        if block.block_hash is not None:
            self._park(block)
        else:
            # Nothing cached in it: put it where the next allocation looks first, so it
            # is reused before any block that could still be a prefix hit.
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def _park(self, block: Block) -> None:
        """Queue a ref-0 cached block at the most recently used end."""
        self._free[block.block_id] = None
        self._num_free_cached += 1

    def _take_free(self) -> Block:
        """Pop the least recently used free block, evicting what it caches; returns it clean."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._num_free_cached -= 1
            self._evict(block)
        block.block_hash, block.parent_hash, block.token_ids, block.filled = None, None, (), 0
        return block

    def _take_imported(self, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple) -> Block:
        """A free block for a full block's KV arriving from elsewhere, listed as cached (ref 0:
        the caller parks or holds it)."""
        block = self._take_free()
        self._list_full(block, block_hash, parent, tokens)
        return block

    def _list_full(self, block: Block, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple) -> None:
        """A block whose whole KV is written (or is about to be), listed as cached under `block_hash`."""
        block.filled = self.block_size
        self._register(block, block_hash, parent, tokens)

    def _check_full(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) != self.block_size:
            raise ValueError(f"a cached block holds {self.block_size} tokens, got {len(token_ids)}")

    def _claim(self) -> Block:
        block = self._take_free()
        block.ref_count = 1
        return block

    def _evict(self, block: Block) -> None:
        del self._cached[block.block_hash]
        self.events.removed(block.block_hash, MEMORY)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash, block.parent_hash, block.token_ids)


def chain_order(parents: Mapping[BlockHash, BlockHash | None]) -> list[BlockHash]:
    """The hashes of `parents` ordered so each follows its parent when that is listed too."""
    ordered: list[BlockHash] = []
    placed: set[BlockHash] = set()
    for start in parents:
        chain = []
        block_hash = start
        while block_hash in parents and block_hash not in placed:  # iterative: chains can be long
            chain.append(block_hash)
            placed.add(block_hash)
            block_hash = parents[block_hash]
        ordered.extend(reversed(chain))
    return ordered
