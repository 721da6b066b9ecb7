"""KVCache with a real pool (and cold tier): KV bytes survive fork, spill, swap and migration.

Tiny geometry: 2 layers, 2 KV heads, head_dim 4, block size 4. KV is written as the
engine would, straight into the pool, from seeded random numbers, and compared bit for bit.
"""

import numpy as np
import pytest

from orchard.kvcache.budget import MemoryBudget
from orchard.kvcache.cache import KVCache
from orchard.kvcache.cold_tier import SlotLayout
from orchard.kvcache.config import CacheConfig, InvalidCacheConfig
from orchard.kvcache.errors import IncompatibleKVPayload, OutOfBlocks, QuotaExceeded
from orchard.kvcache.events import DISK, MEMORY, BlockRemoved, BlockStored
from orchard.kvcache.wire import KVBlockData, decode_blocks, encode_blocks
from tests.kvcache.caches import BS, geometry, kv_of, prefill, random_kv, same_kv

# ------------------------------------------------------------------ construction


def test_pool_and_manager_are_sized_from_the_config(make_cache):
    cache = make_cache(num_blocks=7)
    assert cache.num_blocks == cache.pool.num_blocks == cache.manager.num_blocks == 7
    assert cache.stats().blocks_total == 6
    prefill(cache, "a", list(range(9)), seed=0)
    assert cache.block_table("a") == [1, 2, 3]
    assert cache.manager.sequence_hashes("a") == cache.block_hashes(list(range(9)))
    assert len(cache.block_hashes(list(range(9)))) == 2
    cache.free("a")


def test_config_dtype_that_disagrees_with_the_model_is_rejected():
    with pytest.raises(InvalidCacheConfig) as err:
        KVCache(geometry("float16"), CacheConfig(block_size=BS, num_blocks=4, dtype="bfloat16"))
    assert err.value.field == "dtype"


def test_budget_quota_caps_the_pool_and_is_released_on_close():
    g = geometry()
    budget = MemoryBudget(100 * g.bytes_per_block)
    budget.set_quota("a", 5 * g.bytes_per_block)
    cache = KVCache(g, CacheConfig(block_size=BS, num_blocks=50), budget=budget, model_name="a")
    assert cache.num_blocks == 5
    assert budget.available("a") == 0
    with pytest.raises(QuotaExceeded):
        KVCache(g, CacheConfig(block_size=BS, num_blocks=50), budget=budget, model_name="a")
    cache.close()
    assert budget.available("a") == 5 * g.bytes_per_block


def test_salt_changes_the_hashes_a_cache_computes(make_cache):
    tokens = list(range(8))
    assert make_cache().block_hashes(tokens) != make_cache(salt="tenant").block_hashes(tokens)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("num_blocks", 1),
        ("kv_memory_gb", 0.0),
        ("memory_fraction", 0.0),
        ("memory_fraction", 1.5),
        ("watermark", 1.0),
        ("watermark", -0.1),
        ("dtype", "int8"),
        ("cold_tier_gb", 0),
    ],
)
def test_each_invalid_cache_setting_is_rejected_naming_its_field(field, value):
    with pytest.raises(InvalidCacheConfig) as err:
        CacheConfig(**{field: value})
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_giving_both_a_block_count_and_a_memory_size_is_rejected():
    with pytest.raises(InvalidCacheConfig) as err:
        CacheConfig(num_blocks=8, kv_memory_gb=1.0)
    assert err.value.field == "kv_memory_gb"


def test_cache_config_defaults():
    config = CacheConfig()
    assert (config.block_size, config.num_blocks, config.kv_memory_gb, config.memory_fraction) == (16, None, None, 0.5)
    assert (config.watermark, config.dtype, config.cold_tier_dir, config.cold_tier_gb, config.cache_salt) == (
        0.01, None, None, 4.0, None)


# ------------------------------------------------------------------ copy-on-write


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fork_then_divergent_write_leaves_the_parent_kv_bit_for_bit(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    tokens = list(range(6))
    prefill(cache, "p", tokens, seed=1)
    parent_before = kv_of(cache, cache.block_table("p"))
    cache.fork("p", "c")
    assert cache.ensure_slots("c", 7) == [(2, 3)]
    child_table = cache.block_table("c")
    assert child_table == [1, 3]
    copied = kv_of(cache, [3])
    assert same_kv(copied, kv_of(cache, [2]))
    # the child writes its own token at slot 6 (block 3, offset 2)
    keys, values = copied[0].copy(), copied[1].copy()
    keys[:, 0, 2] += 1 if dtype == "bfloat16" else 1.5
    values[:, 0, 2] += 1 if dtype == "bfloat16" else 1.5
    cache.pool.write_blocks([3], keys, values)
    cache.commit("c", tokens + [99], 7)
    assert same_kv(kv_of(cache, cache.block_table("p")), parent_before)
    child_kv = kv_of(cache, child_table)
    assert np.array_equal(child_kv[0][:, 1, :2], parent_before[0][:, 1, :2])
    assert not np.array_equal(child_kv[0][:, 1, 2], parent_before[0][:, 1, 2])
    cache.free("p")
    cache.free("c")


# ------------------------------------------------------------------ cold tier


def test_evicted_blocks_spill_to_disk_and_come_back_bit_for_bit(make_cache):
    cache = make_cache(num_blocks=4, cold=True)  # 3 usable blocks
    prompt = list(range(8))
    prefill(cache, "a", prompt, seed=2)
    original = kv_of(cache, cache.block_table("a"))
    a0, a1 = cache.block_hashes(prompt)
    cache.free("a")
    cache.drain_events()
    prefill(cache, "b", list(range(100, 112)), seed=3)  # takes block 3, evicts 2 then 1
    events = cache.drain_events()
    assert [(type(e).__name__, e.block_hash, e.tier) for e in events[:4]] == [
        ("BlockRemoved", a1, MEMORY),
        ("BlockStored", a1, DISK),
        ("BlockRemoved", a0, MEMORY),
        ("BlockStored", a0, DISK),
    ]
    assert cache.stats().cold_tier_spills == 2
    cache.free("b")
    assert cache.allocate("a2", prompt + [8]) == 8
    assert same_kv(kv_of(cache, cache.block_table("a2")[:2]), original)
    stats = cache.stats()
    assert stats.cold_tier_hits == 2
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (8 + 12 + 9, 8)
    cache.free("a2")


def test_event_numbers_never_go_back_across_memory_and_disk_events(make_cache):
    cache = make_cache(num_blocks=3, cold=True)
    for index in range(4):
        prefill(cache, index, list(range(10 * index, 10 * index + 8)), seed=index)
        cache.free(index)
    events = cache.drain_events()
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.tier for e in events} == {MEMORY, DISK}
    assert len(events) == 8 + 6 + 6  # 8 stored in memory; 6 evicted, each removed and stored on disk


def test_blocks_dropped_by_the_full_cold_tier_are_announced_as_removed(make_cache):
    stride = SlotLayout.for_geometry(geometry(), 1 << 20).stride
    cache = make_cache(num_blocks=3, cold=True, cold_bytes=2 * stride)
    prefill(cache, "a", list(range(8)), seed=20)
    a0, a1 = cache.block_hashes(list(range(8)))
    cache.free("a")
    prefill(cache, "b", list(range(100, 108)), seed=21)  # spills a1, a0: the tier is full
    cache.free("b")
    cache.drain_events()
    prefill(cache, "c", [7], seed=22)  # spills b's tail, dropping the least recent slot (a1)
    events = cache.drain_events()
    b1 = cache.block_hashes(list(range(100, 108)))[1]
    assert [(type(e), e.block_hash, e.tier) for e in events] == [
        (BlockRemoved, b1, MEMORY),
        (BlockStored, b1, DISK),
        (BlockRemoved, a1, DISK),
    ]
    assert [(s.block_hash, s.tier) for s in cache.snapshot() if s.tier == DISK] == [(a0, DISK), (b1, DISK)]
    cache.free("c")


def test_a_restarted_cache_finds_its_cold_blocks_on_disk(make_cache, tmp_path):
    first = make_cache(num_blocks=3, cold=True, cold_dir=tmp_path / "shared")
    prompt = list(range(8))
    prefill(first, "a", prompt, seed=23)
    original = kv_of(first, first.block_table("a"))
    first.free("a")
    prefill(first, "b", list(range(100, 108)), seed=24)  # spills both of a's blocks
    first.free("b")
    first.close()
    second = make_cache(num_blocks=4, cold=True, cold_dir=tmp_path / "shared")
    assert second.allocate("a", prompt + [8]) == 8
    assert same_kv(kv_of(second, second.block_table("a")[:2]), original)
    second.free("a")


def test_a_restarted_cache_announces_its_disk_blocks_and_drops_stale_swap_blocks(make_cache, tmp_path):
    first = make_cache(num_blocks=4, cold=True, cold_dir=tmp_path / "shared")
    prefill(first, "a", list(range(8)), seed=23)
    first.free("a")
    b_tokens = list(range(100, 110))
    prefill(first, "b", b_tokens, seed=24)  # 3 blocks: evicts and spills both of a's
    assert first.swap_out("b", b_tokens + [9], 10) is True  # 2 full blocks and a partial one
    swap_slots = len(first.cold)
    first.close()
    second = make_cache(num_blocks=4, cold=True, cold_dir=tmp_path / "shared")
    announced = [e for e in second.drain_events() if e.tier == "disk"]
    expected = second.block_hashes(list(range(8))) + second.block_hashes(b_tokens)
    assert sorted(e.block_hash for e in announced) == sorted(expected)
    assert {e.block_hash for e in second.snapshot()} == set(expected)
    assert swap_slots == len(expected) + 1
    assert len(second.cold) == len(expected)  # the swapped partial block of "b" is gone


def test_cold_hit_continues_a_prefix_found_partly_in_memory(make_cache):
    cache = make_cache(num_blocks=5, cold=True)  # 4 usable
    prompt = list(range(12))
    prefill(cache, "a", prompt, seed=4)  # blocks 1, 2, 3
    original = kv_of(cache, cache.block_table("a"))
    cache.free("a")  # LRU: 4, then 3, 2, 1
    prefill(cache, "b", [50, 51, 52, 53, 54], seed=5)  # takes 4, evicts 3 (a's tail)
    cache.free("b")
    assert cache.manager.lookup_prefix(prompt) == [1, 2]
    assert cache.allocate("a2", prompt + [12]) == 12
    table = cache.block_table("a2")
    assert table[:2] == [1, 2]
    assert same_kv(kv_of(cache, table[:3]), original)
    assert cache.stats().cold_tier_hits == 1
    cache.free("a2")


def test_allocate_with_a_cold_tier_raises_out_of_blocks_without_changing_anything(make_cache):
    cache = make_cache(num_blocks=3, cold=True)
    prefill(cache, "a", list(range(8)), seed=6)
    before = (cache.stats(), cache.events.next_seq)
    with pytest.raises(OutOfBlocks):
        cache.allocate("b", [1])
    assert (cache.stats(), cache.events.next_seq) == before
    cache.free("a")


def test_swapped_out_sequence_resumes_with_every_computed_slot_restored(make_cache):
    cache = make_cache(num_blocks=5, cold=True)
    tokens = list(range(11))
    cache.allocate("s", tokens)
    table = cache.block_table("s")
    keys, values = random_kv(cache, 3, seed=7)
    cache.pool.write_blocks(table, keys, values)
    assert cache.swap_out("s", tokens, 10)  # 2 full blocks + 2 slots of the third
    assert cache.manager.num_used == 0
    prefill(cache, "other", list(range(200, 216)), seed=8)  # evicts everything of "s"
    cache.free("other")
    assert cache.swap_in("s", tokens) == 10
    new_table = cache.block_table("s")
    restored = kv_of(cache, new_table)
    assert same_kv((restored[0][:, :2], restored[1][:, :2]), (keys[:, :2], values[:, :2]))
    assert np.array_equal(restored[0][:, 2, :2], keys[:, 2, :2])
    assert np.array_equal(restored[1][:, 2, :2], values[:, 2, :2])
    assert cache.num_computed("s") == 10
    assert cache.stats().cold_tier_hits == 3
    cache.free("s")
    assert cache.swap_in("s", tokens) == 8  # the partial block was handed back once only
    cache.free("s")


def test_swap_in_after_the_partial_block_was_forgotten_restores_full_blocks_only(make_cache):
    cache = make_cache(cold=True)
    tokens = list(range(7))
    prefill(cache, "s", tokens, seed=30)
    assert cache.swap_out("s", tokens, 7)
    cache.forget_swapped("s")
    assert cache.swap_in("s", tokens) == 4
    assert cache.num_computed("s") == 4
    cache.free("s")


def test_swap_out_of_a_sequence_with_nothing_computed_keeps_nothing_and_frees(make_cache):
    cache = make_cache(cold=True)
    cache.allocate("s", [1, 2, 3])
    assert cache.swap_out("s", [1, 2, 3], 0)
    assert cache.stats().cold_tier_spills == 0
    assert cache.swap_in("s", [1, 2, 3]) == 0
    cache.free("s")


def test_prefetch_asks_the_cold_tier_only_for_blocks_memory_lacks(make_cache, monkeypatch):
    cache = make_cache(num_blocks=3, cold=True)
    prompt = list(range(8))
    prefill(cache, "a", prompt, seed=31)
    cache.free("a")
    prefill(cache, "b", [9], seed=32)  # a's tail block goes to disk
    cache.free("b")
    asked = []
    monkeypatch.setattr(cache.cold, "prefetch", lambda keys: asked.append(list(keys)))
    a0, a1 = cache.block_hashes(prompt)
    cache.prefetch([a0, a1])
    assert asked == [[a1]]


def test_swap_in_ignores_a_partial_block_that_a_longer_cached_prefix_superseded(make_cache):
    cache = make_cache(cold=True)
    tokens = [0, 0, 0, 0, 0, 1]
    cache.allocate("s", tokens)
    keys, values = random_kv(cache, 2, seed=33)
    cache.pool.write_blocks(cache.block_table("s"), keys, values)
    assert cache.swap_out("s", tokens, 1)  # only slot 0 computed: a partial block under the swap key
    prefill(cache, "o", [0, 0, 0, 0, 5], seed=34)  # caches the full block [0, 0, 0, 0]
    cache.free("o")
    assert cache.swap_in("s", tokens) == 4
    assert cache.num_computed("s") == 4
    cache.free("s")


def test_swap_out_without_a_cold_tier_frees_and_reports_false(make_cache):
    cache = make_cache()
    prefill(cache, "s", list(range(6)), seed=9)
    assert cache.swap_out("s", list(range(6)), 6) is False
    assert "s" not in cache.manager
    assert cache.swap_in("s", list(range(6)) + [6]) == 4  # the full block is still cached in memory
    cache.free("s")


def test_snapshot_lists_memory_then_disk_blocks_parents_first(make_cache):
    cache = make_cache(num_blocks=3, cold=True)
    prompt = list(range(8))
    prefill(cache, "a", prompt, seed=10)
    cache.free("a")
    prefill(cache, "b", [9, 9, 9, 9], seed=11)  # evicts a's tail block to disk
    a0, a1 = cache.block_hashes(prompt)
    b0 = cache.block_hashes([9, 9, 9, 9])[0]
    snap = cache.snapshot()
    assert [(s.block_hash, s.tier) for s in snap] == [(a0, MEMORY), (b0, MEMORY), (a1, DISK)]
    assert {s.seq for s in snap} == {cache.events.next_seq}
    assert snap[-1] == BlockStored(cache.events.next_seq, a1, a0, (4, 5, 6, 7), DISK)
    cache.free("b")


# ------------------------------------------------------------------ migration


def test_exported_blocks_import_into_another_cache_bit_for_bit(make_cache):
    source, target = make_cache(), make_cache()
    prompt = list(range(10))
    prefill(source, "a", prompt, seed=12)
    original = kv_of(source, source.block_table("a")[:2])
    source.free("a")
    hashes = source.block_hashes(prompt)
    payload = source.export_blocks(hashes + [b"\x07" * 16])
    assert source.manager.num_used == 0
    assert [b.block_hash for b in decode_blocks(payload, source.geometry)] == hashes
    target.drain_events()
    assert target.import_blocks(payload) == 2
    assert [(type(e), e.block_hash) for e in target.drain_events()] == [(BlockStored, h) for h in hashes]
    assert target.import_blocks(payload) == 0
    assert target.allocate("a", prompt) == 8
    assert same_kv(kv_of(target, target.block_table("a")[:2]), original)
    target.free("a")


def test_export_reads_blocks_from_the_cold_tier_after_memory(make_cache):
    cache = make_cache(num_blocks=3, cold=True)
    prompt = list(range(8))
    prefill(cache, "a", prompt, seed=13)
    original = kv_of(cache, cache.block_table("a"))
    cache.free("a")
    prefill(cache, "b", [9], seed=14)  # evicts a's tail block to disk
    cache.free("b")
    blocks = decode_blocks(cache.export_blocks(cache.block_hashes(prompt)), cache.geometry)
    assert [b.token_ids for b in blocks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert np.array_equal(blocks[1].keys, original[0][:, 1])
    assert np.array_equal(blocks[1].values, original[1][:, 1])


def test_import_refuses_blocks_of_another_model(make_cache):
    source, other = make_cache(), make_cache(fingerprint="other-model")
    prefill(source, "a", list(range(8)), seed=15)
    payload = source.export_blocks(source.block_hashes(list(range(8))))
    source.free("a")
    with pytest.raises(IncompatibleKVPayload):
        other.import_blocks(payload)
    assert other.manager.num_cached == 0


def test_import_skips_blocks_that_do_not_chain_from_this_cache_root(make_cache):
    source, salted = make_cache(), make_cache(salt="tenant")
    prefill(source, "a", list(range(8)), seed=16)
    payload = source.export_blocks(source.block_hashes(list(range(8))))
    source.free("a")
    assert salted.import_blocks(payload) == 0
    assert salted.manager.num_cached == 0


def test_import_rejects_a_block_whose_hash_does_not_follow_from_its_tokens(make_cache):
    cache = make_cache()
    keys, values = random_kv(cache, 1, seed=17)
    forged = KVBlockData(cache.block_hashes([1, 2, 3, 4])[0], cache.root, (5, 6, 7, 8), keys[:, 0], values[:, 0])
    with pytest.raises(IncompatibleKVPayload):
        cache.import_blocks(encode_blocks(cache.geometry, [forged]))
    assert cache.manager.num_cached == 0
