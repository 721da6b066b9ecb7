"""The pool stores and returns KV bit for bit, copies blocks across every layer, and never writes block 0."""

import numpy as np
import pytest

from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.pool import KVPool

DTYPES = ["float32", "float16", "bfloat16"]


def tiny_geometry(dtype: str) -> KVGeometry:
    return KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def random_blocks(geometry: KVGeometry, n: int, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included) in the storage dtype, `[layers, n, block, heads, dim]`."""
    rng = np.random.default_rng(seed)
    shape = (geometry.num_layers, n, *geometry.block_shape)
    unsigned = np.dtype(f"uint{8 * geometry.itemsize}")
    bits = rng.integers(0, np.iinfo(unsigned).max, size=shape, dtype=unsigned, endpoint=True)
    return bits.view(geometry.numpy_storage_dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_returns_identical_bits(dtype):
    geometry = tiny_geometry(dtype)
    pool = KVPool(geometry, num_blocks=6)
    keys, values = random_blocks(geometry, 3, seed=1), random_blocks(geometry, 3, seed=2)
    pool.write_blocks([4, 1, 5], keys, values)
    got_keys, got_values = pool.read_blocks([4, 1, 5])
    assert got_keys.dtype == geometry.numpy_storage_dtype
    assert same_bits(got_keys, keys) and same_bits(got_values, values)
    # Reading in another order returns the blocks in that order.
    reordered_keys, _ = pool.read_blocks([5, 4])
    assert same_bits(reordered_keys, keys[:, [2, 0]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_arrays_have_the_layout_and_dtype_of_the_geometry(dtype):
    geometry = tiny_geometry(dtype)
    pool = KVPool(geometry, num_blocks=3)
    assert len(pool.keys) == len(pool.values) == 2
    assert pool.keys[0].shape == (3, 4, 2, 8)
    assert str(pool.values[1].dtype) == f"mlx.core.{dtype}"
    assert pool.nbytes == 3 * 2 * 2 * 4 * 2 * 8 * geometry.itemsize


def test_untouched_blocks_stay_zero_after_a_write():
    geometry = tiny_geometry("float32")
    pool = KVPool(geometry, num_blocks=4)
    pool.write_blocks([2], random_blocks(geometry, 1, 3), random_blocks(geometry, 1, 4))
    keys, values = pool.read_blocks([0, 1, 3])
    assert not keys.any() and not values.any()


def test_copy_blocks_copies_every_layer_and_leaves_the_source():
    geometry = tiny_geometry("bfloat16")
    pool = KVPool(geometry, num_blocks=6)
    keys, values = random_blocks(geometry, 2, 5), random_blocks(geometry, 2, 6)
    pool.write_blocks([1, 2], keys, values)
    pool.copy_blocks([(1, 3), (2, 4)])
    got_keys, got_values = pool.read_blocks([3, 4, 1, 2])
    assert same_bits(got_keys, np.concatenate([keys, keys], axis=1))
    assert same_bits(got_values, np.concatenate([values, values], axis=1))


def test_copy_blocks_reads_all_sources_before_writing():
    geometry = tiny_geometry("float16")
    pool = KVPool(geometry, num_blocks=4)
    keys, values = random_blocks(geometry, 2, 7), random_blocks(geometry, 2, 8)
    pool.write_blocks([1, 2], keys, values)
    pool.copy_blocks([(1, 2), (2, 3)])  # block 2 is both a target and a source
    got_keys, _ = pool.read_blocks([2, 3])
    assert same_bits(got_keys, keys)


def test_write_to_the_null_block_is_refused_and_changes_nothing():
    geometry = tiny_geometry("float32")
    pool = KVPool(geometry, num_blocks=3)
    with pytest.raises(ValueError, match="null block"):
        pool.write_blocks([1, 0], random_blocks(geometry, 2, 9), random_blocks(geometry, 2, 10))
    with pytest.raises(ValueError, match="null block"):
        pool.copy_blocks([(1, 0)])
    keys, _ = pool.read_blocks([0, 1])
    assert not keys.any()


def test_write_rejects_wrong_shape_dtype_and_out_of_range_ids():
    geometry = tiny_geometry("float16")
    pool = KVPool(geometry, num_blocks=3)
    good = random_blocks(geometry, 1, 11)
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([1, 2], good, good)
    with pytest.raises(ValueError, match="dtype"):
        pool.write_blocks([1], good.astype(np.float32), good)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.write_blocks([3], good, good)
    with pytest.raises(ValueError, match="same block twice"):
        pool.write_blocks([1, 1], random_blocks(geometry, 2, 12), random_blocks(geometry, 2, 13))


def test_a_pool_needs_more_than_the_null_block():
    with pytest.raises(ValueError, match="at least one more"):
        KVPool(tiny_geometry("float32"), num_blocks=1)


def test_writes_land_in_arrays_the_engine_swapped_in():
    """The engine replaces pool.keys[l] after a forward pass; writes must go to the new array."""
    import mlx.core as mx

    geometry = tiny_geometry("float32")
    pool = KVPool(geometry, num_blocks=3)
    pool.keys[0] = mx.ones_like(pool.keys[0])
    pool.write_blocks([2], random_blocks(geometry, 1, 14), random_blocks(geometry, 1, 15))
    keys, _ = pool.read_blocks([1])
    assert (keys[0] == 1).all() and not keys[1].any()


def test_writes_and_copies_update_the_pool_in_place():
    """Neither path may allocate a second copy of a layer: the pool is most of memory."""
    import mlx.core as mx

    geometry = KVGeometry("big-enough", num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    pool = KVPool(geometry, num_blocks=256)
    layer_bytes = pool.nbytes // (2 * geometry.num_layers)
    keys, values = random_blocks(geometry, 2, 16), random_blocks(geometry, 2, 17)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pool.write_blocks([1, 2], keys, values)
    pool.copy_blocks([(1, 3), (2, 4)])
    assert mx.get_peak_memory() - before < layer_bytes // 4
    got_keys, _ = pool.read_blocks([3, 4])
    assert same_bits(got_keys, keys)


@pytest.mark.parametrize("ids", [[3, 4, 5], [5, 2, 4]], ids=["consecutive", "scattered"])
def test_a_strided_run_of_blocks_lands_in_consecutive_and_scattered_ids_alike(ids):
    """One buffer holding blocks equally spaced (as a received payload does) is copied per layer,
    through a slice where the ids are consecutive and through an index array otherwise."""
    geometry = tiny_geometry("float32")
    pool = KVPool(geometry, num_blocks=8)
    keys, values = random_blocks(geometry, 3, 18), random_blocks(geometry, 3, 19)
    per_block = keys[:, 0].nbytes
    buffer = bytearray(3 * (2 * per_block + 24))  # K, V and a gap per block, like a payload's headers
    flat = np.frombuffer(buffer, dtype=np.uint8)
    views = []
    for j in range(3):
        at = j * (2 * per_block + 24)
        flat[at : at + per_block] = np.frombuffer(np.ascontiguousarray(keys[:, j]).tobytes(), np.uint8)
        flat[at + per_block : at + 2 * per_block] = np.frombuffer(np.ascontiguousarray(values[:, j]).tobytes(), np.uint8)
        k = flat[at : at + per_block].view(np.float32).reshape(keys[:, j].shape)
        v = flat[at + per_block : at + 2 * per_block].view(np.float32).reshape(keys[:, j].shape)
        views.append((k, v))
    from orchard.kvcache.pool import _as_run

    assert _as_run([k for k, _ in views]) is not None  # the strided path, not block by block
    pool.write_block_arrays(ids, [k for k, _ in views], [v for _, v in views])
    got_keys, got_values = pool.read_blocks(ids)
    assert same_bits(got_keys, keys) and same_bits(got_values, values)
    untouched = [b for b in range(1, 8) if b not in ids]
    assert not pool.read_blocks(untouched)[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_views_share_the_pools_memory_in_every_dtype(dtype):
    """A pull sends from and imports into these views, a bfloat16 pool (most models' KV) included: a
    view that copied would send stale KV and lose what is written through it."""
    geometry = tiny_geometry(dtype)
    pool = KVPool(geometry, num_blocks=5)
    keys, values = random_blocks(geometry, 2, 20), random_blocks(geometry, 2, 21)
    pool.write_blocks([1, 2], keys, values)
    key_views, value_views = pool.layer_views()
    assert key_views[0].dtype == value_views[1].dtype == geometry.numpy_storage_dtype
    assert same_bits(np.stack([view[[1, 2]] for view in key_views]), keys)  # it reads what the pool holds
    key_views[1][3] = keys[1, 0]  # and what is written through it lands in the pool
    value_views[0][4] = values[0, 1]
    del key_views, value_views
    got_keys, got_values = pool.read_blocks([3, 4])
    assert same_bits(got_keys[1, 0], keys[1, 0]) and same_bits(got_values[0, 1], values[0, 1])
    assert not got_keys[0].any() and not got_values[1].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_writes_in_place_while_layer_views_are_held(dtype):
    """An export holds the views on its link thread across engine steps: a step's write must neither
    copy the pool (twice its memory) nor leave the views reading a buffer the pool no longer uses."""
    import mlx.core as mx

    from orchard.kernels.kv_write import write_kv

    geometry = KVGeometry("big-enough", num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    pool = KVPool(geometry, num_blocks=64)
    rows = mx.full((2, 8, 128), 3.0, dtype=getattr(mx, dtype))
    key_views, _ = pool.layer_views()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for layer in range(geometry.num_layers):
        pool.keys[layer], pool.values[layer] = write_kv(pool.keys[layer], pool.values[layer], rows, rows, [35, 36])
    mx.eval(*pool.keys, *pool.values)
    assert mx.get_peak_memory() - before < pool.nbytes // 8
    written = key_views[1][2, 3:5]  # slots 35 and 36: block 2, offsets 3 and 4
    assert same_bits(written, pool.read_blocks([2])[0][1, 0, 3:5]) and written.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_buffer_addresses_are_where_the_layer_views_begin_and_move_only_with_a_layers_buffer(dtype):
    """A landing lists the blocks written through its views only where these still match the views' addresses
    (`orchard.kvcache.block_landing`): they must agree while the buffers stay, a step's write in place included,
    and differ once a layer's buffer is another."""
    import mlx.core as mx

    from orchard.kernels.kv_write import write_kv

    geometry = tiny_geometry(dtype)
    pool = KVPool(geometry, num_blocks=5)
    at = [view.__array_interface__["data"][0] for part in pool.layer_views() for view in part]
    assert pool.buffer_addresses() == at and len(set(at)) == 2 * geometry.num_layers
    rows = mx.ones((1, geometry.num_kv_heads, geometry.head_dim), dtype=getattr(mx, dtype))
    pool.keys[0], pool.values[0] = write_kv(pool.keys[0], pool.values[0], rows, rows, [5])
    mx.eval(*pool.keys, *pool.values)
    assert pool.buffer_addresses() == at  # written in place
    kept = pool.values[-1]  # held, so the copy cannot take its buffer
    pool.values[-1] = kept * 1  # as a step that wrote the layer out of place
    mx.eval(pool.values[-1])
    moved = pool.buffer_addresses()
    assert moved[:-1] == at[:-1] and moved[-1] != at[-1]


def test_there_are_no_buffer_addresses_where_there_are_no_layer_views(monkeypatch):
    """A device whose arrays numpy cannot address gives no views, and so no addresses to compare them with."""
    from orchard.kvcache import pool as pool_module

    pool = KVPool(tiny_geometry("float16"), num_blocks=5)
    monkeypatch.setattr(pool_module, "host_memory", lambda: False)
    assert pool.layer_views() is None and pool.buffer_addresses() is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_that_is_not_one_run_of_memory_gives_neither_views_nor_addresses(dtype):
    """Writing through a view of a broadcast layer would not mean one block: a pull then lands no block straight
    in the pool, and no landing compares addresses."""
    import mlx.core as mx

    pool = KVPool(tiny_geometry(dtype), num_blocks=5)
    shape = pool.keys[0].shape
    pool.keys[0] = mx.broadcast_to(mx.zeros((1, *shape[1:]), dtype=pool.keys[0].dtype), shape)
    assert pool.layer_views() is None and pool.buffer_addresses() is None
