"""BlockManager on a tiny pool: exact block ids, ref counts, eviction order, events, waste.

Block size 4. The free queue starts as 1, 2, ... in order, so the ids below are exact.
Every manager a test builds must end with no block in use (checked on teardown).
"""

import pytest

from orchard.kvcache.block_manager import BlockManager, DuplicateSequence
from orchard.kvcache.errors import OutOfBlocks, UnknownSequence
from orchard.kvcache.events import DISK, MEMORY, BlockRemoved, BlockStored
from orchard.kvcache.hashing import block_hashes, root_hash
from orchard.kvcache.stats import contiguous_waste, paged_waste

BS = 4
ROOT = root_hash("tiny-llama")


@pytest.fixture
def make_manager():
    made = []

    def make(num_blocks=10, **kwargs):
        kwargs.setdefault("watermark", 0.0)
        manager = BlockManager(num_blocks, BS, ROOT, **kwargs)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        assert manager.num_used == 0, "a test leaked blocks"
        assert manager.num_used + manager.num_cached + manager.num_free == manager.num_usable


def refs(manager, block_ids):
    return [manager.block(b).ref_count for b in block_ids]


def run(manager, seq_id, tokens):
    """Allocate and commit a whole prompt, as a finished prefill would."""
    reused = manager.allocate(seq_id, tokens)
    manager.commit(seq_id, tokens, len(tokens))
    return reused


# ------------------------------------------------------------------ allocation


def test_fresh_allocation_takes_blocks_in_order_and_covers_every_slot(make_manager):
    m = make_manager()
    assert m.allocate("a", list(range(10))) == 0
    assert m.block_table("a") == [1, 2, 3]
    assert refs(m, [1, 2, 3]) == [1, 1, 1]
    assert (m.num_used, m.num_cached, m.num_free) == (3, 0, 6)
    m.free("a")


def test_null_block_is_never_handed_out(make_manager):
    m = make_manager(num_blocks=5)
    m.allocate("a", list(range(16)))
    assert m.block_table("a") == [1, 2, 3, 4]
    assert not m.can_allocate([1])
    with pytest.raises(OutOfBlocks):
        m.allocate("b", [1])
    m.free("a")


def test_shared_prefix_reuses_cached_blocks_and_bumps_ref_counts(make_manager):
    m = make_manager()
    prompt = list(range(10))
    run(m, "a", prompt)
    assert m.allocate("b", prompt[:8] + [50, 51]) == 8
    assert m.block_table("b") == [1, 2, 4]
    assert refs(m, [1, 2, 3, 4]) == [2, 2, 1, 1]
    m.free("a")
    m.free("b")


def test_freed_hashed_blocks_stay_cached_and_hit_again(make_manager):
    m = make_manager()
    prompt = list(range(10))
    run(m, "a", prompt)
    m.free("a")
    assert (m.num_used, m.num_cached, m.num_free) == (0, 2, 7)
    assert m.lookup_prefix(prompt) == [1, 2]
    assert m.allocate("b", prompt) == 8
    assert m.block_table("b")[:2] == [1, 2]
    assert m.num_cached == 0
    m.free("b")


def test_fully_cached_aligned_prompt_leaves_its_last_block_to_recompute(make_manager):
    m = make_manager()
    prompt = list(range(8))
    run(m, "a", prompt)
    m.free("a")  # queue: 3..9, then 2 (tail of a), then 1
    assert m.lookup_prefix(prompt) == [1, 2]
    assert m.allocate("b", prompt) == 4
    assert m.block_table("b") == [1, 3]
    assert m.num_computed("b") == 4
    assert m.block(2).ref_count == 0 and m.cached_block(m.block(2).block_hash) == 2
    m.free("b")


def test_lookup_prefix_changes_nothing(make_manager):
    m = make_manager()
    run(m, "a", list(range(8)))
    m.free("a")
    before = (m.stats(), m.events.next_seq, list(m._free))
    assert m.lookup_prefix(list(range(8)) + [7]) == [1, 2]
    assert m.lookup_prefix([9, 9, 9, 9]) == []
    assert (m.stats(), m.events.next_seq, list(m._free)) == before


def test_out_of_blocks_on_allocate_leaves_state_unchanged(make_manager):
    m = make_manager(num_blocks=5)
    run(m, "a", list(range(8)))
    before = (m.stats(), m.events.next_seq, list(m._free), m.block_table("a"))
    with pytest.raises(OutOfBlocks):
        m.allocate("b", list(range(8)) + list(range(100, 109)))  # 2 hits + 3 new > 2 free
    assert (m.stats(), m.events.next_seq, list(m._free), m.block_table("a")) == before
    assert "b" not in m
    m.free("a")


def test_can_allocate_counts_ref_zero_prefix_hits_as_taken(make_manager):
    m = make_manager(num_blocks=5)
    prompt = list(range(8))
    run(m, "a", prompt)
    m.free("a")
    assert m.can_allocate(prompt + list(range(100, 108)))  # 2 hits + 2 new = 4 blocks
    assert not m.can_allocate(prompt + list(range(100, 112)))  # 2 hits + 3 new
    assert not m.can_allocate(list(range(200, 217)))  # 5 blocks, no hits


def test_watermark_holds_back_admission_but_not_allocation(make_manager):
    m = make_manager(num_blocks=11, watermark=0.2)  # 10 usable, 2 in reserve
    assert m.watermark_blocks == 2
    assert m.can_allocate(list(range(32)))  # 8 blocks, 2 spare
    assert not m.can_allocate(list(range(33)))  # 9 blocks, 1 spare
    assert m.can_allocate(list(range(33)), keep_watermark=False)
    m.allocate("a", list(range(33)))
    assert m.num_used == 9
    m.free("a")


def test_blocks_reserved_for_landing_kv_leave_the_watermark_free(make_manager):
    m = make_manager(num_blocks=11, watermark=0.2)  # 10 usable, 2 in reserve
    held = m.reserve(20)
    assert len(held) == 8 and m.num_available == 2
    assert m.lookup_prefix(list(range(8))) == [] and m.num_cached == 0
    m.unpin(held)
    assert m.num_available == 10


def test_duplicate_and_unknown_sequence_ids_are_named_errors(make_manager):
    m = make_manager()
    m.allocate("a", [1, 2])
    with pytest.raises(DuplicateSequence):
        m.allocate("a", [1, 2])
    for call in (m.free, m.block_table, lambda s: m.ensure_slots(s, 4), lambda s: m.fork(s, "c")):
        with pytest.raises(UnknownSequence):
            call("nope")
    with pytest.raises(ValueError):
        m.allocate("b", [])
    m.free("a")


# ------------------------------------------------------------------ eviction


def test_eviction_takes_least_recent_first_and_a_sequence_tail_before_its_head(make_manager):
    evicted = []
    m = make_manager(num_blocks=5, on_evict=lambda bid, h, parent, toks: evicted.append((bid, toks)))
    run(m, "a", [1, 1, 1, 1, 2, 2, 2, 2])  # blocks 1, 2
    m.free("a")
    run(m, "b", [3, 3, 3, 3, 4, 4, 4, 4])  # blocks 3, 4
    m.free("b")
    # queue, least recent first: 2, 1 (a's tail first), then 4, 3
    m.allocate("c", list(range(100, 112)))
    assert m.block_table("c") == [2, 1, 4]
    assert evicted == [(2, (2, 2, 2, 2)), (1, (1, 1, 1, 1)), (4, (4, 4, 4, 4))]
    assert m.lookup_prefix([3, 3, 3, 3]) == [3]
    assert m.stats().evictions == 3
    m.free("c")


def test_prefix_hit_refreshes_a_block_in_the_lru(make_manager):
    m = make_manager(num_blocks=4)
    run(m, "a", [1, 1, 1, 1])  # block 1
    m.free("a")
    run(m, "b", [2, 2, 2, 2])  # block 2
    m.free("b")
    m.allocate("a2", [1, 1, 1, 1, 5])  # hits block 1, takes 3
    m.free("a2")  # 3 (unhashed) to the head; 1 now more recent than 2
    m.allocate("c", list(range(100, 108)))
    assert m.block_table("c") == [3, 2]
    assert m.lookup_prefix([1, 1, 1, 1]) == [1]
    assert m.lookup_prefix([2, 2, 2, 2]) == []
    m.free("c")


def test_unhashed_freed_block_is_reused_before_any_cached_block(make_manager):
    m = make_manager(num_blocks=4)
    run(m, "a", list(range(6)))  # block 1 full and hashed, block 2 partial
    m.free("a")
    run(m, "b", [9, 9, 9, 9, 9])  # takes 2 (partial, nothing to lose), then 3
    assert m.block_table("b") == [2, 3]
    assert m.lookup_prefix(list(range(4))) == [1]
    assert m.stats().evictions == 0
    m.free("b")


def test_evict_hook_sees_the_block_before_it_is_reused(make_manager):
    seen = []

    def on_evict(block_id, block_hash, parent_hash, token_ids):
        block = m.block(block_id)
        listed = m.cached_block(block_hash)
        seen.append((block_id, block.ref_count, block.token_ids, listed, parent_hash, token_ids))

    m = make_manager(num_blocks=3, on_evict=on_evict)
    tokens = [7, 7, 7, 7, 8, 8, 8, 8]
    run(m, "a", tokens)
    m.free("a")
    m.allocate("b", [1])
    h0, h1 = block_hashes(tokens, BS, ROOT)
    # intact and unreferenced, no longer a prefix hit, not yet handed out
    assert seen == [(2, 0, (8, 8, 8, 8), None, h0, (8, 8, 8, 8))]
    assert m.block_table("b") == [2]
    assert m.cached_block(h1) is None and m.cached_block(h0) == 1
    m.free("b")


# ------------------------------------------------------------------ growth and copy-on-write


def test_ensure_slots_appends_blocks_only_when_needed(make_manager):
    m = make_manager()
    run(m, "a", list(range(4)))
    assert m.ensure_slots("a", 4) == []
    assert m.block_table("a") == [1]
    assert m.ensure_slots("a", 5) == []
    assert m.block_table("a") == [1, 2]
    assert m.ensure_slots("a", 13) == []
    assert m.block_table("a") == [1, 2, 3, 4]
    m.free("a")


def test_holds_slots_only_while_the_blocks_to_write_are_held_and_not_shared(make_manager):
    m = make_manager()
    run(m, "p", list(range(6)))  # BS 4: blocks [1, 2], 6 slots computed
    assert m.holds_slots("p", 8)  # the rest of block 2
    assert not m.holds_slots("p", 9)  # needs a third block
    m.fork("p", "c")
    assert not m.holds_slots("c", 7)  # block 2 is shared: writing it copies
    assert m.holds_slots("c", 6)  # nothing left to write
    assert m.ensure_slots("c", 7) == [(2, 3)]
    assert m.holds_slots("c", 8) and m.holds_slots("p", 8)  # each holds its own block now
    m.free("p")
    m.free("c")


def test_fork_shares_every_block(make_manager):
    m = make_manager()
    run(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.block_table("c") == [1, 2]
    assert refs(m, [1, 2]) == [2, 2]
    assert m.num_computed("c") == 6
    with pytest.raises(DuplicateSequence):
        m.fork("p", "c")
    m.free("p")
    assert refs(m, [1, 2]) == [1, 1]
    m.free("c")


def test_first_divergent_write_after_fork_copies_the_partial_block(make_manager):
    m = make_manager()
    run(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.ensure_slots("c", 7) == [(2, 3)]
    assert m.block_table("c") == [1, 3]
    assert refs(m, [1, 2, 3]) == [2, 1, 1]
    assert m.ensure_slots("p", 7) == []  # block 2 is the parent's alone now
    assert m.block_table("p") == [1, 2]
    m.free("p")
    m.free("c")


def test_shared_block_with_no_kv_yet_is_replaced_without_a_copy(make_manager):
    m = make_manager()
    run(m, "p", list(range(8)))
    m.ensure_slots("p", 9)  # block 3 reserved, nothing written
    m.fork("p", "c")
    assert m.ensure_slots("c", 9) == []
    assert m.block_table("c") == [1, 2, 4]
    assert refs(m, [1, 2, 3, 4]) == [2, 2, 1, 1]
    m.free("p")
    m.free("c")


def test_out_of_blocks_on_ensure_slots_leaves_state_unchanged(make_manager):
    m = make_manager(num_blocks=4)
    run(m, "p", list(range(6)))  # blocks 1, 2
    m.fork("p", "c")
    assert not m.can_append("c", 9)  # copy of block 2 plus one new block, one free
    before = (m.stats(), list(m._free), m.block_table("c"), refs(m, [1, 2, 3]))
    with pytest.raises(OutOfBlocks):
        m.ensure_slots("c", 9)
    assert (m.stats(), list(m._free), m.block_table("c"), refs(m, [1, 2, 3])) == before
    assert m.can_append("c", 8)
    m.free("p")
    m.free("c")


# ------------------------------------------------------------------ commit, hashes, events


def test_commit_hashes_only_full_computed_blocks_and_emits_stored_events(make_manager):
    m = make_manager()
    tokens = list(range(10))
    m.allocate("a", tokens)
    m.commit("a", tokens, 5)
    h0, h1 = block_hashes(tokens, BS, ROOT)
    assert [m.block(b).block_hash for b in (1, 2, 3)] == [h0, None, None]
    m.commit("a", tokens, 10)
    assert [m.block(b).block_hash for b in (1, 2, 3)] == [h0, h1, None]
    events = m.events.drain()
    assert events == [
        BlockStored(0, h0, ROOT, (0, 1, 2, 3), MEMORY),
        BlockStored(1, h1, h0, (4, 5, 6, 7), MEMORY),
    ]
    m.free("a")


def test_commit_refuses_to_go_back_or_past_the_block_table(make_manager):
    m = make_manager()
    tokens = list(range(6))
    m.allocate("a", tokens)
    m.commit("a", tokens, 5)
    with pytest.raises(ValueError):
        m.commit("a", tokens, 4)
    with pytest.raises(ValueError):
        m.commit("a", tokens + [6, 7, 8], 9)  # table covers 8 slots
    m.free("a")


def test_identical_prompts_computed_twice_register_one_block_per_hash(make_manager):
    m = make_manager()
    tokens = list(range(6))
    m.allocate("a", tokens)
    m.allocate("b", tokens)  # nothing cached yet: blocks 3, 4
    m.commit("a", tokens, 6)
    m.commit("b", tokens, 6)
    h0 = block_hashes(tokens, BS, ROOT)[0]
    assert m.cached_block(h0) == 1
    assert m.block(3).block_hash is None
    longer = tokens + [6, 7, 8]
    m.ensure_slots("b", 9)
    m.commit("b", longer, 8)  # b's second block chains from h0 even though its first is unhashed
    assert m.sequence_hashes("b") == block_hashes(longer, BS, ROOT)
    assert m.cached_block(block_hashes(longer, BS, ROOT)[1]) == 4
    stored = [e for e in m.events.drain() if isinstance(e, BlockStored)]
    assert [e.block_hash for e in stored] == block_hashes(longer, BS, ROOT)
    m.free("a")
    m.free("b")


def test_event_sequence_numbers_increase_across_stores_and_removals(make_manager):
    m = make_manager(num_blocks=3)
    run(m, "a", list(range(8)))
    m.free("a")
    run(m, "b", list(range(100, 108)))
    m.free("b")
    events = m.events.drain()
    assert [e.seq for e in events] == list(range(6))
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 2 + ["BlockRemoved"] * 2 + ["BlockStored"] * 2
    a0, a1 = block_hashes(list(range(8)), BS, ROOT)
    assert events[2:4] == [BlockRemoved(2, a1, MEMORY), BlockRemoved(3, a0, MEMORY)]
    assert m.events.drain() == []


# ------------------------------------------------------------------ pins, imports, snapshots


def test_pin_holds_cached_blocks_against_pressure_and_stops_at_the_first_miss(make_manager):
    m = make_manager(num_blocks=4)
    tokens = list(range(8))
    run(m, "a", tokens)
    m.free("a")
    h0, h1 = block_hashes(tokens, BS, ROOT)
    assert m.pin([h0, b"\x00" * 16, h1]) == [1]
    assert refs(m, [1, 2]) == [1, 0]
    assert not m.can_allocate(list(range(100, 109)))  # 3 blocks, 2 takeable
    m.allocate("b", list(range(100, 108)))  # takes 3, then evicts 2
    assert m.block_table("b") == [3, 2]
    assert m.lookup_prefix(tokens) == [1]
    m.unpin([1])
    assert m.num_cached == 1
    m.free("b")


def test_import_cached_lists_a_block_as_most_recent_and_refuses_duplicates(make_manager):
    m = make_manager(num_blocks=4)
    tokens = list(range(8))
    h0, h1 = block_hashes(tokens, BS, ROOT)
    assert m.import_cached(h0, ROOT, tokens[:4]) == 1
    assert m.import_cached(h0, ROOT, tokens[:4]) is None
    assert m.import_cached(h1, h0, tokens[4:]) == 2
    assert (m.num_used, m.num_cached, m.num_free) == (0, 2, 1)
    assert m.events.drain() == [BlockStored(0, h0, ROOT, (0, 1, 2, 3)), BlockStored(1, h1, h0, (4, 5, 6, 7))]
    assert m.allocate("a", tokens + [8]) == 8
    assert m.block_table("a") == [1, 2, 3]
    assert m.import_cached(b"\x01" * 16, ROOT, [0, 0, 0, 0]) is None  # nothing free
    with pytest.raises(ValueError):
        m.import_cached(b"\x02" * 16, ROOT, [0, 0])
    m.free("a")


def test_import_run_holds_the_blocks_it_takes_skips_those_cached_and_stops_when_none_is_free(make_manager):
    m = make_manager(num_blocks=4)
    tokens = list(range(16))
    hashes = block_hashes(tokens, BS, ROOT)
    parents = [ROOT, *hashes[:-1]]
    chunks = [tuple(tokens[i : i + BS]) for i in range(0, 16, BS)]
    assert m.import_cached(hashes[1], parents[1], chunks[1]) == 1
    assert m.pin([hashes[1]]) == [1]
    m.events.drain()
    assert m.import_run(hashes, parents, chunks) == ([0, 2], [2, 3])  # index 1 cached; index 3 finds no free block
    assert refs(m, [1, 2, 3]) == [1, 1, 1]
    assert (m.num_used, m.num_cached, m.num_free) == (3, 0, 0)
    assert m.events.drain() == [BlockStored(1, hashes[0], ROOT, chunks[0]), BlockStored(2, hashes[2], hashes[1], chunks[2])]
    m.unpin([3, 2, 1])
    assert (m.num_used, m.num_cached) == (0, 3)
    with pytest.raises(ValueError):
        m.import_run([b"\x01" * 16], [ROOT], [(0, 0)])


def test_snapshot_lists_cached_blocks_parents_first_numbered_at_the_next_event(make_manager):
    m = make_manager()
    tokens = list(range(12))
    h0, h1, h2 = block_hashes(tokens, BS, ROOT)
    # import the chain out of order: child before parent in the hash map
    m.import_cached(h2, h1, tokens[8:])
    m.import_cached(h0, ROOT, tokens[:4])
    m.import_cached(h1, h0, tokens[4:8])
    snap = m.snapshot()
    assert [s.block_hash for s in snap] == [h0, h1, h2]
    assert {s.seq for s in snap} == {3}
    assert snap[1] == BlockStored(3, h1, h0, (4, 5, 6, 7), MEMORY)
    assert all(s.tier != DISK for s in snap)


# ------------------------------------------------------------------ accounting


def test_fragmentation_is_unfilled_slots_over_allocated_slots(make_manager):
    m = make_manager(num_blocks=12)
    lengths = [5, 9, 4]
    for index, n in enumerate(lengths):
        run(m, index, list(range(100 * index, 100 * index + n)))
    stats = m.stats()
    assert (stats.allocated_slots, stats.kv_slots) == (24, 18)
    assert stats.fragmentation == pytest.approx(6 / 24)
    assert stats.fragmentation == pytest.approx(paged_waste(lengths, BS))
    assert contiguous_waste(lengths, 16) == pytest.approx(30 / 48)
    for index in range(3):
        m.free(index)
    assert m.stats().allocated_slots == 0 and m.stats().fragmentation == 0.0


def test_reserved_but_uncomputed_slots_count_as_waste_and_shared_blocks_count_once(make_manager):
    m = make_manager()
    tokens = list(range(6))
    m.allocate("a", tokens)
    assert (m.stats().allocated_slots, m.stats().kv_slots) == (8, 0)
    m.commit("a", tokens, 6)
    m.fork("a", "b")
    assert (m.stats().allocated_slots, m.stats().kv_slots) == (8, 6)
    m.ensure_slots("b", 7)  # copy of the partial block carries its 2 computed slots
    assert (m.stats().allocated_slots, m.stats().kv_slots) == (12, 8)
    m.free("a")
    m.free("b")


def test_prefix_accounting_counts_query_and_hit_tokens(make_manager):
    m = make_manager()
    run(m, "a", list(range(10)))
    run(m, "b", list(range(8)) + [1])
    stats = m.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (19, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 19)
    m.free("a")
    m.free("b")
