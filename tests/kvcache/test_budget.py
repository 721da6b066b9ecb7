"""Pool sizing follows the config's mode, and quotas keep two models' KV memory apart."""

from dataclasses import dataclass

import pytest

import orchard.kvcache.budget as budget_module
from orchard.kvcache.budget import MemoryBudget, num_blocks_for
from orchard.kvcache.errors import QuotaExceeded
from orchard.kvcache.geometry import KVGeometry

GIB = 1 << 30


@dataclass
class SizingConfig:
    """Stands in for kvcache.config.CacheConfig: num_blocks_for only reads these fields."""

    block_size: int = 4
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    memory_fraction: float = 0.5


GEOMETRY = KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
BLOCK = GEOMETRY.bytes_per_block  # 512 bytes


def test_explicit_num_blocks_wins():
    assert num_blocks_for(GEOMETRY, SizingConfig(num_blocks=7, kv_memory_gb=1.0)) == 7


def test_kv_memory_gb_is_divided_by_the_block_size_in_bytes():
    assert BLOCK == 512
    assert num_blocks_for(GEOMETRY, SizingConfig(kv_memory_gb=1 / 1024)) == (GIB // 1024) // 512


def test_memory_fraction_takes_that_share_of_free_memory(monkeypatch):
    monkeypatch.setattr(budget_module, "free_memory_bytes", lambda: 100 * BLOCK)
    assert num_blocks_for(GEOMETRY, SizingConfig(memory_fraction=0.25)) == 25


def test_sizes_too_small_for_a_usable_block_still_give_null_plus_one(monkeypatch):
    monkeypatch.setattr(budget_module, "free_memory_bytes", lambda: 10)
    assert num_blocks_for(GEOMETRY, SizingConfig(memory_fraction=1.0)) == 2


def test_explicit_block_count_below_two_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for(GEOMETRY, SizingConfig(num_blocks=1))


def test_config_block_size_must_match_the_geometry():
    with pytest.raises(ValueError, match="block_size 16 disagrees"):
        num_blocks_for(GEOMETRY, SizingConfig(block_size=16, num_blocks=4))


def test_free_memory_on_this_machine_is_positive():
    assert budget_module.free_memory_bytes() > 0


def test_quota_caps_the_pool_size():
    shared = MemoryBudget(total_bytes=100 * BLOCK)
    shared.set_quota("small", 10 * BLOCK)
    assert num_blocks_for(GEOMETRY, SizingConfig(num_blocks=50), budget=shared, model_name="small") == 10
    assert num_blocks_for(GEOMETRY, SizingConfig(num_blocks=4), budget=shared, model_name="small") == 4


def test_quota_too_small_for_a_pool_raises_quota_exceeded():
    shared = MemoryBudget(total_bytes=100 * BLOCK)
    shared.set_quota("tiny", BLOCK)
    with pytest.raises(QuotaExceeded, match="'tiny'"):
        num_blocks_for(GEOMETRY, SizingConfig(num_blocks=4), budget=shared, model_name="tiny")
    with pytest.raises(QuotaExceeded):
        num_blocks_for(GEOMETRY, SizingConfig(num_blocks=4), budget=shared, model_name="never-given-a-quota")


def test_a_budget_without_a_model_name_is_refused():
    with pytest.raises(ValueError, match="model_name"):
        num_blocks_for(GEOMETRY, SizingConfig(num_blocks=4), budget=MemoryBudget(GIB))


def test_quotas_may_not_sum_past_the_total():
    shared = MemoryBudget(total_bytes=1000)
    shared.set_quota("a", 600)
    with pytest.raises(ValueError, match="400 of 1000 bytes are not assigned"):
        shared.set_quota("b", 401)
    shared.set_quota("b", 400)
    shared.set_quota("a", 500)  # replacing a quota counts only the new figure
    assert (shared.quota("a"), shared.quota("b"), shared.unassigned) == (500, 400, 100)


def test_one_models_reservations_cannot_take_the_others_quota():
    shared = MemoryBudget(total_bytes=1000)
    shared.set_quota("llama", 700)
    shared.set_quota("qwen", 300)
    shared.reserve("llama", 700)
    with pytest.raises(QuotaExceeded, match="'llama' asked for 1 bytes with 700 of its 700-byte quota"):
        shared.reserve("llama", 1)
    shared.reserve("qwen", 300)
    assert (shared.reserved("llama"), shared.reserved("qwen")) == (700, 300)


def test_a_refused_reservation_takes_nothing():
    shared = MemoryBudget(total_bytes=1000)
    shared.set_quota("a", 100)
    shared.reserve("a", 60)
    with pytest.raises(QuotaExceeded):
        shared.reserve("a", 50)
    assert shared.reserved("a") == 60 and shared.available("a") == 40


def test_release_returns_bytes_and_refuses_more_than_held():
    shared = MemoryBudget(total_bytes=1000)
    shared.set_quota("a", 100)
    shared.reserve("a", 80)
    shared.release("a", 30)
    assert shared.reserved("a") == 50
    shared.reserve("a", 50)
    with pytest.raises(ValueError, match="cannot release 101"):
        shared.release("a", 101)


def test_a_quota_cannot_shrink_below_what_the_model_holds():
    shared = MemoryBudget(total_bytes=1000)
    shared.set_quota("a", 500)
    shared.reserve("a", 400)
    with pytest.raises(ValueError, match="below the 400 bytes"):
        shared.set_quota("a", 300)


def test_two_models_sized_from_one_budget_each_fit_their_quota():
    shared = MemoryBudget(total_bytes=30 * BLOCK)
    shared.set_quota("first", 20 * BLOCK)
    shared.set_quota("second", 10 * BLOCK)
    sizes = {}
    for name in ("first", "second"):
        sizes[name] = num_blocks_for(GEOMETRY, SizingConfig(kv_memory_gb=1.0), budget=shared, model_name=name)
        shared.reserve(name, sizes[name] * BLOCK)
    assert sizes == {"first": 20, "second": 10}
    # Once the first model's pool holds its whole quota, nothing is left for a second pool of it.
    with pytest.raises(QuotaExceeded):
        num_blocks_for(GEOMETRY, SizingConfig(num_blocks=2), budget=shared, model_name="first")


def test_sizes_a_pool_from_the_real_cache_config():
    from orchard.kvcache.config import CacheConfig

    assert num_blocks_for(GEOMETRY, CacheConfig(block_size=4, num_blocks=9)) == 9
    assert num_blocks_for(GEOMETRY, CacheConfig(block_size=4, kv_memory_gb=1 / 1024)) == 2048
