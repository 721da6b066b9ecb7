"""PrefixIndex: events in, lookups out; gaps force snapshots; nodes come and go."""

from __future__ import annotations

import pytest

from orchard.cluster.coordinator.prefix_index import PrefixIndex, UnknownTier
from orchard.kvcache.events import DISK, MEMORY, BlockRemoved, BlockStored, EventLog
from orchard.kvcache.hashing import block_hashes, root_hash

BS = 4


def chain(tokens, salt=None):
    return block_hashes(tokens, BS, root_hash("demo-model", salt))


def store_all(log: EventLog, hashes, tier=MEMORY):
    parent = None
    for h in hashes:
        log.stored(h, parent, (0,) * BS, tier)
        parent = h
    return log.drain()


PROMPT = chain(list(range(16)))  # 4 blocks
OTHER = chain(list(range(100, 116)))


def test_match_counts_leading_blocks_per_node():
    index = PrefixIndex()
    a, b = EventLog(), EventLog()
    assert index.apply("a", store_all(a, PROMPT))
    assert index.apply("b", store_all(b, PROMPT[:2]))
    assert index.match(PROMPT) == {"a": 4, "b": 2}
    assert index.match(PROMPT[:3]) == {"a": 3, "b": 2}
    assert index.match(OTHER) == {}


def test_match_stops_at_first_block_nobody_holds():
    index = PrefixIndex()
    log = EventLog()
    # Node holds blocks 0, 1 and 3 but not 2: only the unbroken run counts.
    index.apply("a", store_all(log, [PROMPT[0], PROMPT[1], PROMPT[3]]))
    assert index.match(PROMPT) == {"a": 2}


def test_a_node_with_a_hole_stops_counting_while_others_continue():
    index = PrefixIndex()
    a, b = EventLog(), EventLog()
    index.apply("a", store_all(a, [PROMPT[0], PROMPT[2], PROMPT[3]]))
    index.apply("b", store_all(b, PROMPT))
    assert index.match(PROMPT) == {"a": 1, "b": 4}


def test_removed_event_drops_the_entry_and_empty_hashes_vanish():
    index = PrefixIndex()
    log = EventLog()
    index.apply("a", store_all(log, PROMPT))
    log.removed(PROMPT[1])
    assert index.apply("a", log.drain())
    assert index.match(PROMPT) == {"a": 1}
    assert len(index) == 3
    assert index.num_entries == 3
    assert index.holders(PROMPT[1]) == {}


def test_block_spilled_to_disk_stays_a_hit_with_disk_tier():
    index = PrefixIndex()
    log = EventLog()
    index.apply("a", store_all(log, PROMPT[:1]))
    log.stored(PROMPT[0], None, (0,) * BS, DISK)
    log.removed(PROMPT[0], MEMORY)
    assert index.apply("a", log.drain())
    assert index.holders(PROMPT[0]) == {"a": DISK}
    assert index.match(PROMPT) == {"a": 1}
    assert index.num_entries == 1


def test_memory_tier_wins_when_block_is_in_both_tiers():
    index = PrefixIndex()
    log = EventLog()
    log.stored(PROMPT[0], None, (0,) * BS, DISK)
    log.stored(PROMPT[0], None, (0,) * BS, MEMORY)
    index.apply("a", log.drain())
    assert index.holders(PROMPT[0]) == {"a": MEMORY}


def test_gap_in_sequence_numbers_demands_a_snapshot_and_ignores_events_until_then():
    index = PrefixIndex()
    log = EventLog()
    assert index.apply("a", store_all(log, PROMPT[:1]))
    store_all(log, PROMPT[1:2])  # this batch is lost in transit
    assert not index.apply("a", store_all(log, PROMPT[2:3]))
    assert index.needs_snapshot("a")
    assert index.match(PROMPT) == {"a": 1}
    # Still refused until the snapshot arrives, even if contiguous again.
    assert not index.apply("a", store_all(log, PROMPT[3:4]))
    index.load_snapshot("a", log.next_seq, [(h, MEMORY) for h in PROMPT])
    assert not index.needs_snapshot("a")
    assert index.match(PROMPT) == {"a": 4}
    assert index.stats().gaps_seen == 1


def test_snapshot_replaces_the_nodes_entries_and_later_events_apply_from_its_seq():
    index = PrefixIndex()
    log = EventLog()
    index.apply("a", store_all(log, OTHER))
    index.load_snapshot("a", log.next_seq, [(PROMPT[0], MEMORY)])
    assert index.match(OTHER) == {}
    assert index.match(PROMPT) == {"a": 1}
    assert index.apply("a", store_all(log, PROMPT[1:2]))
    assert index.match(PROMPT) == {"a": 2}


def test_events_older_than_the_snapshot_are_skipped():
    index = PrefixIndex()
    log = EventLog()
    late = store_all(log, OTHER[:1])  # taken before the snapshot, delivered after it
    index.load_snapshot("a", log.next_seq, [(PROMPT[0], MEMORY)])
    assert index.apply("a", late)
    assert index.match(OTHER) == {}


def test_resent_batch_is_applied_once():
    index = PrefixIndex()
    log = EventLog()
    batch = store_all(log, PROMPT[:2])
    index.apply("a", batch)
    assert index.apply("a", batch)
    assert index.num_entries == 2
    assert index.next_seq("a") == 2


def test_remove_node_drops_only_its_entries():
    index = PrefixIndex()
    a, b = EventLog(), EventLog()
    index.apply("a", store_all(a, PROMPT))
    index.apply("b", store_all(b, PROMPT[:2] + OTHER))
    index.remove_node("a")
    assert index.match(PROMPT) == {"b": 2}
    assert index.num_entries == 6
    assert len(index) == 6
    assert index.next_seq("a") == 0


def test_require_snapshot_empties_node_until_snapshot():
    index = PrefixIndex()
    log = EventLog()
    index.apply("a", store_all(log, PROMPT))
    index.require_snapshot("a")
    assert index.match(PROMPT) == {}
    assert not index.apply("a", store_all(log, OTHER))
    index.load_snapshot("a", 0, [])
    assert index.apply("a", [BlockStored(0, OTHER[0], None, (1, 2, 3, 4))])
    assert index.match(OTHER) == {"a": 1}


def test_removing_an_unknown_block_is_harmless():
    index = PrefixIndex()
    assert index.apply("a", [BlockRemoved(0, PROMPT[0])])
    assert index.num_entries == 0


def test_unknown_tier_is_refused():
    index = PrefixIndex()
    with pytest.raises(UnknownTier):
        index.apply("a", [BlockStored(0, PROMPT[0], None, (), tier="tape")])


def test_salted_chains_do_not_match_each_other():
    index = PrefixIndex()
    log = EventLog()
    tokens = list(range(16))
    index.apply("a", store_all(log, chain(tokens, salt="tenant-1")))
    assert index.match(chain(tokens, salt="tenant-2")) == {}
    assert index.match(chain(tokens, salt="tenant-1")) == {"a": 4}


def test_a_hybrid_node_counts_its_run_only_to_its_last_state():
    index = PrefixIndex()
    a, b, c = EventLog(), EventLog(), EventLog()
    index.apply("a", store_all(a, PROMPT))
    a.state_stored(PROMPT[1])
    index.apply("a", a.drain())
    index.apply("b", store_all(b, PROMPT[:3]))
    b.state_stored(PROMPT[2])
    index.apply("b", b.drain())
    index.apply("c", store_all(c, PROMPT))  # blocks, and no state a resume could start from
    assert index.match(PROMPT) == {"a": 4, "b": 3, "c": 4}
    assert index.match(PROMPT, resume_at_states=["a", "b", "c"]) == {"a": 2, "b": 3}
    assert index.match(PROMPT, resume_at_states=["a"]) == {"a": 2, "b": 3, "c": 4}  # others count blocks
    b.state_removed(PROMPT[2])
    index.apply("b", b.drain())
    assert index.match(PROMPT, resume_at_states=["a", "b"]) == {"a": 2, "c": 4}
    assert index.holders(PROMPT[1]) == {"a": MEMORY, "b": MEMORY, "c": MEMORY}  # the state bit is no tier to read from
