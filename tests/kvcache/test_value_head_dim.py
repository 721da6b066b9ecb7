"""Keys and values of different head dims (DeepSeek-V2: keys of 192, values of 128) through the pool,
the wire format and the cold tier; a geometry of one width travels and is stored as it was before."""

import dataclasses

import msgpack
import numpy as np
import pytest

from orchard.kvcache.cold_tier import ColdTier, SlotLayout
from orchard.kvcache.errors import IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import block_hashes, root_hash
from orchard.kvcache.pool import KVPool
from orchard.kvcache.wire import KVBlockData, decode_blocks, encode_blocks
from orchard.kvcache.wire_stream import BlockPieces, decode_views
from tests.kvcache.wire_pieces import encode_pieces

ONE_WIDTH = KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
#: keys 24 wide (16 nope + 8 rope), values 12, as the tiny DeepSeek-V2 of the family tests
SPLIT = dataclasses.replace(ONE_WIDTH, head_dim=24, value_head_dim=12)


def random_array(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    unsigned = np.dtype(f"uint{8 * dtype.itemsize}")
    bits = np.random.default_rng(seed).integers(0, np.iinfo(unsigned).max, size=shape, dtype=unsigned)
    return bits.view(dtype)


def block_arrays(geometry: KVGeometry, seed: int, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One block's K and V over all layers (`n` blocks: `[num_layers, n, ...]` as the pool reads them)."""
    blocks = () if n is None else (n,)
    dtype = geometry.numpy_storage_dtype
    keys = random_array((geometry.num_layers, *blocks, *geometry.key_block_shape), dtype, 2 * seed)
    values = random_array((geometry.num_layers, *blocks, *geometry.value_block_shape), dtype, 2 * seed + 1)
    return keys, values


def chained_blocks(geometry: KVGeometry, n: int = 3) -> list[KVBlockData]:
    tokens = list(range(100, 100 + n * geometry.block_size))
    hashes = block_hashes(tokens, geometry.block_size, root_hash(geometry.model_fingerprint))
    return [KVBlockData(hashes[i], hashes[i - 1] if i else None,
                        tuple(tokens[i * geometry.block_size:(i + 1) * geometry.block_size]), *block_arrays(geometry, i))
            for i in range(n)]


def assert_same_blocks(got: list[KVBlockData], want: list[KVBlockData]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()


def test_a_value_dim_equal_to_the_key_dim_is_the_one_width_geometry():
    stated = KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16",
                        value_head_dim=8)
    assert stated == ONE_WIDTH and stated.value_head_dim is None and stated.value_dim == 8
    assert dataclasses.replace(ONE_WIDTH, head_dim=16).value_block_shape == (4, 2, 16)


def test_a_one_width_geometry_travels_with_the_fields_it_always_had():
    assert ONE_WIDTH.to_dict() == {"model_fingerprint": "tiny-model", "num_layers": 2, "num_kv_heads": 2,
                                   "head_dim": 8, "block_size": 4, "dtype": "float16"}
    assert SlotLayout.for_geometry(ONE_WIDTH, 1 << 20).to_dict().keys() == {"record_size", "kv_half", "stride",
                                                                             "slot_count"}


def test_a_split_geometry_counts_k_and_v_bytes_each_at_its_width():
    assert SPLIT.key_block_shape == (4, 2, 24) and SPLIT.value_block_shape == (4, 2, 12)
    assert SPLIT.bytes_per_block == 2 * 4 * 2 * (24 + 12) * 2
    assert SPLIT.bytes_per_token == 2 * 2 * (24 + 12) * 2
    assert KVGeometry.from_dict(SPLIT.to_dict()) == SPLIT
    with pytest.raises(ValueError, match="key_ or value_"):
        _ = SPLIT.block_shape


def test_pool_allocates_values_at_their_own_width_and_round_trips_them():
    pool = KVPool(SPLIT, num_blocks=6)
    assert all(k.shape == (6, 4, 2, 24) and v.shape == (6, 4, 2, 12) for k, v in zip(pool.keys, pool.values))
    assert pool.nbytes == 6 * SPLIT.bytes_per_block
    keys, values = block_arrays(SPLIT, seed=1, n=2)
    pool.write_blocks([3, 5], keys, values)
    read_keys, read_values = pool.read_blocks([3, 5])
    assert read_keys.tobytes() == keys.tobytes() and read_values.tobytes() == values.tobytes()
    with pytest.raises(ValueError, match="values has shape"):
        pool.write_blocks([2], keys[:, :1], keys[:, :1])


def test_pool_takes_block_arrays_of_a_split_geometry():
    pool = KVPool(SPLIT, num_blocks=6)
    blocks = [block_arrays(SPLIT, seed) for seed in range(2)]
    pool.write_block_arrays([4, 1], [k for k, _ in blocks], [v for _, v in blocks])
    read_keys, read_values = pool.read_blocks([4, 1])
    for i, (k, v) in enumerate(blocks):
        assert read_keys[:, i].tobytes() == k.tobytes() and read_values[:, i].tobytes() == v.tobytes()


def test_wire_round_trips_a_split_geometry_in_both_encodings():
    blocks = chained_blocks(SPLIT)
    payload = encode_blocks(SPLIT, blocks)
    assert_same_blocks(decode_blocks(payload, SPLIT), blocks)
    pieces = encode_pieces(SPLIT, [BlockPieces(b.block_hash, b.parent_hash, b.token_ids, list(b.keys), list(b.values))
                                   for b in blocks])
    assert_same_blocks(decode_blocks(b"".join(bytes(p) for p in pieces), SPLIT), blocks)
    assert_same_blocks(decode_views(payload, SPLIT), blocks)


@pytest.mark.parametrize("sender, receiver", [(SPLIT, dataclasses.replace(SPLIT, value_head_dim=16)),
                                              (dataclasses.replace(SPLIT, value_head_dim=24), SPLIT),
                                              (SPLIT, dataclasses.replace(SPLIT, value_head_dim=24))])
def test_a_payload_of_another_value_width_is_refused_naming_it(sender, receiver):
    payload = encode_blocks(sender, chained_blocks(sender))
    for decode in (decode_blocks, decode_views):
        with pytest.raises(IncompatibleKVPayload, match="value_dim"):
            decode(payload, receiver)


def test_cold_tier_keeps_k_and_v_of_their_own_widths(tmp_path):
    capacity = 3 * SlotLayout.for_geometry(SPLIT, 1 << 40).stride
    with ColdTier(tmp_path, SPLIT, capacity) as tier:
        keys, values = block_arrays(SPLIT, seed=7)
        tier.put(b"k" * 16, keys, values, token_ids=[1, 2, 3, 4], parent_hash=None)
        block = tier.get(b"k" * 16)
    assert block.keys.tobytes() == keys.tobytes() and block.values.tobytes() == values.tobytes()
    with ColdTier(tmp_path, SPLIT, capacity) as reopened:
        assert reopened.get(b"k" * 16).values.tobytes() == values.tobytes()


def test_a_cold_file_of_another_value_width_is_not_read(tmp_path):
    other = dataclasses.replace(SPLIT, value_head_dim=16)
    with ColdTier(tmp_path, other, 3 * SlotLayout.for_geometry(other, 1 << 40).stride) as tier:
        tier.put(b"k" * 16, *block_arrays(other, seed=7), token_ids=[1, 2, 3, 4], parent_hash=None)
    with ColdTier(tmp_path, SPLIT, 3 * SlotLayout.for_geometry(SPLIT, 1 << 40).stride) as tier:
        assert tier.get(b"k" * 16) is None


def test_split_sizes_are_written_to_the_cold_header_by_name():
    layout = SlotLayout.for_geometry(SPLIT, 1 << 20)
    assert SlotLayout.from_dict(msgpack.unpackb(msgpack.packb(layout.to_dict()))) == layout
    assert layout.key_bytes == 2 * 4 * 2 * 24 * 2 and layout.value_bytes == 2 * 4 * 2 * 12 * 2
