"""The cold tier restores spilled blocks bit for bit, keeps an exact LRU under its byte
budget, survives a restart, and never reads a file made for something else as KV."""

import dataclasses
import logging
import shutil

import numpy as np
import pytest

from orchard.kvcache.cold_tier import HEADER_REGION, ColdTier, SlotLayout, cold_file_path
from orchard.kvcache.errors import ColdTierError
from orchard.kvcache.geometry import KVGeometry

TINY = KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
#: Blocks of 32 KiB, so a slot spans whole pages that MADV_DONTNEED really releases.
PAGE_SPANNING = dataclasses.replace(TINY, head_dim=256, dtype="float32")


def block_arrays(geometry: KVGeometry, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    unsigned = np.dtype(f"uint{8 * geometry.itemsize}")
    shape = (2, geometry.num_layers, *geometry.block_shape)
    bits = rng.integers(0, np.iinfo(unsigned).max, size=shape, dtype=unsigned, endpoint=True)
    k, v = bits.view(geometry.numpy_storage_dtype)
    return k, v


def key(i: int) -> bytes:
    return bytes([i]) * 16


def capacity_for(geometry: KVGeometry, slots: int) -> int:
    return slots * SlotLayout.for_geometry(geometry, 1 << 40).stride


def spill(tier: ColdTier, i: int, seed: int | None = None) -> list[bytes]:
    k, v = block_arrays(tier.geometry, i if seed is None else seed)
    return tier.put(key(i), k, v, token_ids=[i, i + 1, i + 2, i + 3], parent_hash=key(i - 1) if i else None)


def assert_restores(tier: ColdTier, i: int, seed: int | None = None) -> None:
    k, v = block_arrays(tier.geometry, i if seed is None else seed)
    block = tier.get(key(i))
    assert block is not None, f"block {i} missing"
    assert block.keys.tobytes() == k.tobytes() and block.values.tobytes() == v.tobytes()
    assert block.keys.dtype == tier.geometry.numpy_storage_dtype and block.keys.shape == k.shape
    assert block.token_ids == (i, i + 1, i + 2, i + 3)
    assert block.parent_hash == (key(i - 1) if i else None)
    assert block.block_hash == key(i)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_spill_and_restore_are_bit_exact(tmp_path, dtype):
    geometry = dataclasses.replace(TINY, dtype=dtype)
    with ColdTier(tmp_path, geometry, capacity_for(geometry, 4)) as tier:
        for i in range(4):
            assert spill(tier, i) == []
        for i in range(4):
            assert_restores(tier, i)


def test_partial_block_keeps_its_token_count(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        k, v = block_arrays(TINY, 0)
        tier.put(b"preempted-tail", k, v, token_ids=[7, 8], parent_hash=None)
        assert tier.get(b"preempted-tail").token_ids == (7, 8)


def test_restored_arrays_are_private_copies(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 1)
        first = tier.get(key(1))
        first.keys[...] = 0
        assert_restores(tier, 1)


def test_least_recently_used_block_is_dropped_first(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 3)) as tier:
        assert tier.stats().slots_total == 3
        for i in (1, 2, 3):
            spill(tier, i)
        assert tier.get(key(1)) is not None  # a cold hit makes 1 the most recent
        assert spill(tier, 4) == [key(2)]
        assert spill(tier, 5) == [key(3)]
        assert tier.keys() == [key(1), key(4), key(5)]
        assert key(2) not in tier and tier.get(key(2)) is None
        for i in (1, 4, 5):
            assert_restores(tier, i)


def test_overwriting_a_key_refreshes_it_without_dropping(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 1)
        spill(tier, 2)
        assert spill(tier, 1, seed=99) == []
        assert tier.keys() == [key(2), key(1)] and len(tier) == 2
        assert_restores(tier, 1, seed=99)
        assert spill(tier, 3) == [key(2)]


def test_stats_count_hits_misses_spills_and_drops(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        for i in (1, 2, 3):
            spill(tier, i)
        tier.get(key(3))
        tier.get(key(1))
        tier.discard(key(2))
        stats = tier.stats()
        stride = tier.layout.stride
        assert (stats.slots_used, stats.slots_total, stats.bytes_used, stats.bytes_capacity) == (1, 2, stride, 2 * stride)
        assert (stats.hits, stats.misses, stats.spills, stats.drops, stats.discards) == (1, 1, 3, 1, 1)


@pytest.mark.parametrize("geometry", [TINY, PAGE_SPANNING], ids=["sub-page", "page-spanning"])
def test_prefetch_and_discard_leave_other_blocks_intact(tmp_path, geometry):
    with ColdTier(tmp_path, geometry, capacity_for(geometry, 5)) as tier:
        for i in range(5):
            spill(tier, i)
        tier.prefetch([key(i) for i in range(5)] + [b"unknown"])
        assert tier.discard(key(2)) is True
        assert tier.discard(key(2)) is False
        assert tier.get(key(2)) is None and len(tier) == 4
        for i in (0, 1, 3, 4):
            assert_restores(tier, i)
        assert spill(tier, 7) == []  # the discarded slot is reused, nothing dropped
        assert_restores(tier, 7)
        assert_restores(tier, 3)


def test_capacity_below_one_slot_is_refused(tmp_path):
    with pytest.raises(ValueError, match="below one slot"):
        ColdTier(tmp_path, TINY, capacity_for(TINY, 1) - 1)


def test_put_refuses_blocks_of_another_shape_or_dtype(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        k, v = block_arrays(TINY, 0)
        with pytest.raises(ValueError, match="expected"):
            tier.put(key(1), k.astype(np.float32), v, [1], None)
        with pytest.raises(ValueError, match="1..4 tokens"):
            tier.put(key(1), k, v, [1, 2, 3, 4, 5], None)
        assert len(tier) == 0


def test_reopening_the_file_recovers_blocks_in_lru_order(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 4)) as tier:
        for i in (1, 2, 3):
            spill(tier, i)
        tier.get(key(1))
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 4)) as reopened:
        assert reopened.keys() == [key(2), key(3), key(1)]
        for i in (2, 3, 1):  # hits in LRU order keep the order
            assert_restores(reopened, i)
        assert spill(reopened, 4) == []
        assert spill(reopened, 5) == [key(2)]


def test_entries_list_recovered_blocks_metadata_in_lru_order(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 4)) as tier:
        for i in (0, 1, 2):
            spill(tier, i)
        tier.get(key(0))
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 4)) as reopened:
        assert reopened.entries() == [
            (key(1), key(0), (1, 2, 3, 4)),
            (key(2), key(1), (2, 3, 4, 5)),
            (key(0), None, (0, 1, 2, 3)),
        ]


def test_a_file_written_for_another_model_is_ignored(tmp_path, caplog):
    other = dataclasses.replace(TINY, model_fingerprint="another-model")
    with ColdTier(tmp_path, other, capacity_for(TINY, 2)) as foreign:
        spill(foreign, 1)
    shutil.copy(cold_file_path(tmp_path, other), cold_file_path(tmp_path, TINY))
    with caplog.at_level(logging.WARNING, logger="orchard.kvcache.cold_tier"):
        tier = ColdTier(tmp_path, TINY, capacity_for(TINY, 2))
    with tier:
        assert len(tier) == 0 and tier.get(key(1)) is None
        assert "model_fingerprint: expected 'tiny-model', got 'another-model'" in caplog.text
        spill(tier, 2)
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as replaced:
        assert replaced.keys() == [key(2)]


def test_the_same_model_with_another_dtype_starts_empty_and_another_capacity_is_a_resize(tmp_path, caplog):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 1)
    bf16 = dataclasses.replace(TINY, dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="orchard.kvcache.cold_tier"):
        with ColdTier(tmp_path, bf16, capacity_for(bf16, 2)) as tier:
            assert len(tier) == 0
            spill(tier, 2)
        with ColdTier(tmp_path, bf16, capacity_for(bf16, 3)) as tier:
            assert tier.keys() == [key(2)]
    assert "dtype: expected 'bfloat16', got 'float16'" in caplog.text
    assert "resized from 2 to 3 slots" in caplog.text


def test_a_corrupted_header_is_ignored_and_replaced(tmp_path, caplog):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 1)
    path = cold_file_path(tmp_path, TINY)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="orchard.kvcache.cold_tier"):
        with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
            assert len(tier) == 0 and tier.get(key(1)) is None
    assert "header checksum mismatch" in caplog.text


def test_a_file_that_is_not_a_cold_tier_is_ignored(tmp_path, caplog):
    cold_file_path(tmp_path, TINY).write_bytes(b"some other program's data" * 100)
    with caplog.at_level(logging.WARNING, logger="orchard.kvcache.cold_tier"):
        with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
            assert len(tier) == 0
            spill(tier, 1)
            assert_restores(tier, 1)
    assert "not a cold tier file" in caplog.text


def test_a_damaged_slot_reads_as_a_miss_not_as_kv(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 1)
        spill(tier, 2)
    path = cold_file_path(tmp_path, TINY)
    raw = bytearray(path.read_bytes())
    layout = SlotLayout.for_geometry(TINY, capacity_for(TINY, 2))
    raw[HEADER_REGION + layout.record_size + 5] ^= 0x01  # one KV byte of slot 0 (block 1)
    path.write_bytes(bytes(raw))
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)) as tier:
        assert tier.get(key(1)) is None
        assert tier.stats().corrupt == 1 and key(1) not in tier
        assert_restores(tier, 2)


def test_a_second_tier_on_an_open_file_is_refused(tmp_path):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 2)):
        with pytest.raises(ColdTierError, match="in use"):
            ColdTier(tmp_path, TINY, capacity_for(TINY, 2))
    ColdTier(tmp_path, TINY, capacity_for(TINY, 2)).close()


def test_the_file_is_0600_in_a_0700_folder_even_if_an_older_one_was_open(tmp_path):
    folder = tmp_path / "cold"
    folder.mkdir(mode=0o755)
    path = cold_file_path(folder, TINY)
    path.write_bytes(b"")
    path.chmod(0o644)
    with ColdTier(folder, TINY, capacity_for(TINY, 2)) as tier:
        spill(tier, 0)
    assert path.stat().st_mode & 0o777 == 0o600
    assert folder.stat().st_mode & 0o777 == 0o700


def test_a_symlink_at_the_files_path_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("do not overwrite")
    folder = tmp_path / "cold"
    folder.mkdir(mode=0o700)
    cold_file_path(folder, TINY).symlink_to(target)
    with pytest.raises(ColdTierError, match="symlink"):
        ColdTier(folder, TINY, capacity_for(TINY, 2))
    assert target.read_text() == "do not overwrite"


@pytest.mark.parametrize("slots_after", [6, 3])
def test_resizing_keeps_the_most_recent_blocks_instead_of_wiping(tmp_path, slots_after):
    with ColdTier(tmp_path, TINY, capacity_for(TINY, 4)) as tier:
        for i in range(4):
            spill(tier, i)
        tier.get(key(0))  # now the most recent
    with ColdTier(tmp_path, TINY, capacity_for(TINY, slots_after)) as tier:
        assert tier.layout.slot_count == slots_after
        expected = [0, 1, 2, 3] if slots_after >= 4 else [0, 2, 3]  # block 1 was least recent
        for i in expected:
            assert_restores(tier, i)
        assert len(tier) == len(expected)
        for i in range(10, 10 + slots_after - len(expected)):
            assert spill(tier, i) == []  # the new room is free
