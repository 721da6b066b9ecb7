"""Random allocate / extend / compute / fork / free / pin / pressure runs against BlockManager.

Beside the manager the machine keeps a shadow pool: the token each slot's KV was computed
from. Writes go only where the engine would write (after `ensure_slots`), copy-on-write
pairs are applied to the shadow, so a wrong prefix hit, a missed copy or a write into a
shared block shows up as a slot holding the wrong token.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from orchard.kvcache.block_manager import BlockManager
from orchard.kvcache.errors import OutOfBlocks
from orchard.kvcache.hashing import root_hash

BS = 2
NUM_BLOCKS = 10
tokens_strategy = st.lists(st.integers(0, 1), min_size=1, max_size=10)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.evicted: list[tuple[int, tuple]] = []
        self.m = BlockManager(NUM_BLOCKS, BS, root_hash("prop"), watermark=0.0, on_evict=self._on_evict)
        self.tokens: dict[int, list[int]] = {}
        self.pins: list[list[int]] = []
        self.shadow: dict[int, dict[int, int]] = {b: {} for b in range(NUM_BLOCKS)}
        self.next_id = 0

    def _on_evict(self, block_id, block_hash, parent_hash, token_ids):
        block = self.m.block(block_id)
        assert block.ref_count == 0 and block_id not in self.m._free
        assert tuple(self.shadow[block_id].get(i) for i in range(BS)) == token_ids  # a spill would be right
        self.evicted.append((block_id, token_ids))

    def _state(self):
        m = self.m
        return (
            list(m._free),
            dict(m._cached),
            [(b.ref_count, b.block_hash, b.filled) for b in m._blocks],
            {s: m.block_table(s) for s in self.tokens},
            m.events.next_seq,
            m.stats(),
        )

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def _apply_copies(self, copies):
        for src, dst in copies:
            self.shadow[dst] = dict(self.shadow[src])

    # ------------------------------------------------------------------ rules

    @rule(tokens=tokens_strategy)
    def allocate(self, tokens):
        seq_id = self._new_id()
        if not self.m.can_allocate(tokens, keep_watermark=False):
            before = self._state()
            try:
                self.m.allocate(seq_id, tokens)
            except OutOfBlocks:
                assert self._state() == before
                return
            raise AssertionError("can_allocate said no but allocate succeeded")
        expected_hits = self.m.lookup_prefix(tokens)[: self.m.max_reusable_blocks(len(tokens))]
        reused = self.m.allocate(seq_id, tokens)
        assert reused == len(expected_hits) * BS < len(tokens)
        assert self.m.block_table(seq_id)[: len(expected_hits)] == expected_hits
        assert len(self.m.block_table(seq_id)) == -(-len(tokens) // BS)
        self.tokens[seq_id] = list(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def extend(self, data, extra):
        seq_id = self._pick(data)
        tokens = self.tokens[seq_id] + extra
        if not self.m.can_append(seq_id, len(tokens)):
            before = self._state()
            try:
                self.m.ensure_slots(seq_id, len(tokens))
            except OutOfBlocks:
                assert self._state() == before
                return
            raise AssertionError("can_append said no but ensure_slots succeeded")
        self._apply_copies(self.m.ensure_slots(seq_id, len(tokens)))
        self.tokens[seq_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        """What one engine step does: make the target slots writable, write, commit."""
        seq_id = self._pick(data)
        done = self.m.num_computed(seq_id)
        limit = min(len(self.m.block_table(seq_id)) * BS, len(self.tokens[seq_id]))
        target = data.draw(st.integers(done, limit))
        if not self.m.can_append(seq_id, target):
            return
        self._apply_copies(self.m.ensure_slots(seq_id, target))
        table = self.m.block_table(seq_id)
        for slot in range(done, target):
            block_id = table[slot // BS]
            assert self.m.block(block_id).ref_count == 1, "write into a shared block"
            self.shadow[block_id][slot % BS] = self.tokens[seq_id][slot]
        self.m.commit(seq_id, self.tokens[seq_id], target)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        child = self._new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        assert self.m.block_table(child) == self.m.block_table(parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self._pick(data)
        self.m.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pin(self, data):
        hashes = self.m.sequence_hashes(self._pick(data))
        pinned = self.m.pin(hashes)
        assert pinned == [self.m.cached_block(h) for h in hashes[: len(pinned)]]
        self.pins.append(pinned)

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        self.m.unpin(self.pins.pop(0))

    @rule(length=st.integers(1, 2 * NUM_BLOCKS))
    def pressure(self, length):
        """A burst of unseen tokens takes every block it can, evicting cached prefixes."""
        tokens = [7] * length
        length = min(length, self.m.num_available * BS)
        if length == 0:
            return
        seq_id = self._new_id()
        self.m.allocate(seq_id, tokens[:length])
        assert self.m.num_cached <= self.m.num_available
        self.m.free(seq_id)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def block_counts_partition_the_pool(self):
        m = self.m
        assert m.num_used + m.num_cached + m.num_free == m.num_usable == NUM_BLOCKS - 1
        assert min(m.num_used, m.num_cached, m.num_free) >= 0

    @invariant()
    def ref_counts_match_tables_and_pins(self):
        m = self.m
        expected = [0] * NUM_BLOCKS
        for seq_id in self.tokens:
            for block_id in m.block_table(seq_id):
                expected[block_id] += 1
        for pinned in self.pins:
            for block_id in pinned:
                expected[block_id] += 1
        assert [b.ref_count for b in m._blocks] == expected
        assert expected[0] == 0 and 0 not in m._free
        assert set(m._free) == {b for b in range(1, NUM_BLOCKS) if expected[b] == 0}

    @invariant()
    def every_cached_hash_maps_to_one_block_holding_it(self):
        m = self.m
        assert len(set(m._cached.values())) == len(m._cached)
        for block_hash, block_id in m._cached.items():
            assert m.block(block_id).block_hash == block_hash
        hashed = [b for b in m._blocks if b.block_hash is not None]
        assert len(hashed) == len(m._cached)
        assert m.num_cached == sum(1 for b in hashed if b.ref_count == 0)

    @invariant()
    def slots_hold_the_tokens_their_kv_came_from(self):
        m = self.m
        for seq_id, tokens in self.tokens.items():
            table = m.block_table(seq_id)
            for slot in range(m.num_computed(seq_id)):
                assert self.shadow[table[slot // BS]].get(slot % BS) == tokens[slot]
        for block_id in m._cached.values():
            content = tuple(self.shadow[block_id].get(i) for i in range(BS))
            assert content == m.block(block_id).token_ids

    @invariant()
    def kv_slot_count_matches_what_sequences_computed(self):
        m = self.m
        filled = [0] * NUM_BLOCKS
        for block in m._blocks:
            if block.ref_count and block.block_hash is not None:
                filled[block.block_id] = BS
        for seq_id in self.tokens:
            for index, block_id in enumerate(m.block_table(seq_id)):
                here = min(BS, max(0, m.num_computed(seq_id) - index * BS))
                filled[block_id] = max(filled[block_id], here)
        stats = m.stats()
        assert stats.kv_slots == sum(filled)
        assert stats.allocated_slots == m.num_used * BS

    def teardown(self):
        for seq_id in list(self.tokens):
            self.m.free(seq_id)
        for pinned in self.pins:
            self.m.unpin(pinned)
        assert self.m.num_used == 0
        assert self.m.stats().kv_slots == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---------------------------------------------------------------------------------------
# The same kind of run one level up: KVCache with a real pool and a small cold tier.
# Every slot's KV is a function of the tokens up to and including it, so any slot that a
# prefix hit, a cold restore, a swap-in or a copy-on-write filled wrongly is caught.

import shutil  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from orchard.kvcache.cache import KVCache  # noqa: E402
from orchard.kvcache.cold_tier import SlotLayout  # noqa: E402
from orchard.kvcache.config import CacheConfig  # noqa: E402
from orchard.kvcache.geometry import KVGeometry  # noqa: E402
from orchard.kvcache.wire import decode_blocks  # noqa: E402

GEOMETRY = KVGeometry("prop-model", num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32")
COLD_SLOTS = 6


def slot_kv(prefix) -> tuple[float, float, float, float]:
    """K (2 values) and V (2 values) that the slot holding prefix[-1] gets; exact in float32."""
    v = float(xxhash.xxh3_64_intdigest(np.asarray(prefix, dtype="<u4").tobytes()) % (1 << 20))
    return v, v + 1, v + 2, v + 3


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvcache-prop-")
        stride = SlotLayout.for_geometry(GEOMETRY, 1 << 20).stride
        config = CacheConfig(block_size=BS, num_blocks=12, watermark=0.0, cold_tier_dir=self.dir,
                             cold_tier_gb=COLD_SLOTS * stride / (1 << 30))
        self.cache = KVCache(GEOMETRY, config)
        self.tokens: dict[int, list[int]] = {}
        self.swapped: dict[int, list[int]] = {}
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _write(self, seq_id, start, end):
        """Write the KV of slots [start, end) the way a forward pass would."""
        if start == end:
            return
        table = self.cache.block_table(seq_id)
        blocks = sorted({table[s // BS] for s in range(start, end)}, key=table.index)
        keys, values = self.cache.pool.read_blocks(blocks)
        for slot in range(start, end):
            j, offset = blocks.index(table[slot // BS]), slot % BS
            k0, k1, v0, v1 = slot_kv(self.tokens[seq_id][: slot + 1])
            keys[0, j, offset, 0] = (k0, k1)
            values[0, j, offset, 0] = (v0, v1)
        self.cache.pool.write_blocks(blocks, keys, values)

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def allocate(self, data, tokens):
        """Admit a prompt, preempting the oldest sequences to disk until it fits, then prefill."""
        while not self.cache.can_allocate(tokens) and self.tokens:
            self._swap_out(min(self.tokens))
        if not self.cache.can_allocate(tokens):
            return
        seq_id = self._new_id()
        self.tokens[seq_id] = list(tokens)
        reused = self.cache.allocate(seq_id, tokens)
        assert reused % BS == 0 and reused < len(tokens)
        self._compute(seq_id, data, [])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), max_size=4))
    def compute(self, data, extra):
        self._compute(data.draw(st.sampled_from(sorted(self.tokens))), data, extra)

    def _compute(self, seq_id, data, extra):
        tokens = self.tokens[seq_id] + extra
        if not self.cache.can_append(seq_id, len(tokens)):
            return
        self.cache.ensure_slots(seq_id, len(tokens))
        self.tokens[seq_id] = tokens
        done = self.cache.num_computed(seq_id)
        target = data.draw(st.integers(done, len(tokens)))
        self._write(seq_id, done, target)
        self.cache.commit(seq_id, tokens, target)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 1))
    def fork(self, data, token):
        """Fork as n > 1 sampling does; the child then goes its own way by one token."""
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self._compute(child, data, [token])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        self._swap_out(data.draw(st.sampled_from(sorted(self.tokens))))

    def _swap_out(self, seq_id):
        assert self.cache.swap_out(seq_id, self.tokens[seq_id], self.cache.num_computed(seq_id))
        self.swapped[seq_id] = self.tokens.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        tokens = self.swapped[seq_id]
        if not self.cache.can_allocate(tokens):
            return
        del self.swapped[seq_id]
        self.tokens[seq_id] = tokens
        restored = self.cache.swap_in(seq_id, tokens)
        assert restored == self.cache.num_computed(seq_id) < len(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def export(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id]
        blocks = decode_blocks(self.cache.export_blocks(self.cache.block_hashes(tokens)), GEOMETRY)
        for index, block in enumerate(blocks):
            assert block.token_ids == tuple(tokens[index * BS : (index + 1) * BS])
            for offset in range(BS):
                k0, k1, v0, v1 = slot_kv(tokens[: index * BS + offset + 1])
                assert tuple(block.keys[0, offset, 0]) == (k0, k1)
                assert tuple(block.values[0, offset, 0]) == (v0, v1)

    @invariant()
    def every_computed_slot_holds_the_kv_of_its_prefix(self):
        for seq_id, tokens in self.tokens.items():
            table = self.cache.block_table(seq_id)
            keys, values = self.cache.pool.read_blocks(table)
            for slot in range(self.cache.num_computed(seq_id)):
                k0, k1, v0, v1 = slot_kv(tokens[: slot + 1])
                assert tuple(keys[0, slot // BS, slot % BS, 0]) == (k0, k1), f"seq {seq_id} slot {slot}"
                assert tuple(values[0, slot // BS, slot % BS, 0]) == (v0, v1)

    @invariant()
    def counts_partition_the_pool(self):
        stats = self.cache.stats()
        assert stats.blocks_used + stats.blocks_cached + stats.blocks_free == stats.blocks_total

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        assert self.cache.stats().blocks_used == 0
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)


KVCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
