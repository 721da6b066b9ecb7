"""orchard.kvcache.cold_states: state snapshots in fixed mmap slots, exact bytes, LRU, reopened by a restart."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.kvcache.cold_states import ColdStates
from orchard.kvcache.errors import ColdTierError
from orchard.kvcache.geometry import StateArray, StateGeometry

GEOMETRY = StateGeometry(((StateArray((3, 8), "bfloat16"), StateArray((2, 4, 4), "float32")),
                          (StateArray((3, 8), "bfloat16"), StateArray((2, 4, 4), "float32"))))


def snapshot(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 2**16, (3, 8), dtype=np.uint16), rng.standard_normal((2, 4, 4)).astype(np.float32)]
            for _ in range(2)]


def key(i: int) -> bytes:
    return bytes([i]) * 16


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_a_snapshot_comes_back_bit_for_bit(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 4)
    store.put(key(1), snapshot(1))
    assert same(store.get(key(1)), snapshot(1))
    assert store.get(key(2)) is None
    store.close()


def test_the_least_recently_used_snapshot_makes_room(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    assert store.put(key(1), snapshot(1)) == []
    store.put(key(2), snapshot(2))
    store.get(key(1))  # now the most recent
    assert store.put(key(3), snapshot(3)) == [key(2)]
    assert store.keys() == [key(1), key(3)]
    store.close()


def test_a_reopened_file_keeps_its_snapshots_in_lru_order(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 3)
    for i in (1, 2, 3):
        store.put(key(i), snapshot(i))
    store.get(key(1))
    store.discard(key(2))
    store.close()
    reopened = ColdStates(tmp_path / "s.statecold", GEOMETRY, 3)
    assert reopened.keys() == [key(3), key(1)]
    assert same(reopened.get(key(3)), snapshot(3))
    assert reopened.put(key(4), snapshot(4)) == []  # the discarded slot is free again
    reopened.close()


def test_a_file_for_another_state_geometry_is_wiped(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    store.put(key(1), snapshot(1))
    store.close()
    other = StateGeometry(GEOMETRY.layers[:1])
    reopened = ColdStates(tmp_path / "s.statecold", other, 2)
    assert len(reopened) == 0
    reopened.close()


def test_a_damaged_snapshot_is_dropped_not_returned(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    store.put(key(1), snapshot(1))
    store._mm[store._offset(store._index[key(1)]) + 70] ^= 0x01
    assert store.get(key(1)) is None and key(1) not in store
    store.close()


def test_arrays_of_another_shape_or_dtype_are_refused(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    wrong = snapshot(1)
    wrong[1][1] = wrong[1][1].astype(np.float16)
    with pytest.raises(ValueError, match="is not"):
        store.put(key(1), wrong)
    with pytest.raises(ValueError, match="layers"):
        store.put(key(1), snapshot(1)[:1])
    assert len(store) == 0
    store.close()


def test_one_file_serves_one_store(tmp_path):
    store = ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    with pytest.raises(ColdTierError, match="in use"):
        ColdStates(tmp_path / "s.statecold", GEOMETRY, 2)
    store.close()
