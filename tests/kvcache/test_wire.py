"""The wire format round-trips blocks bit for bit and refuses, each with its own error, anything else."""

import dataclasses

import msgpack
import numpy as np
import pytest

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import block_hashes, root_hash
from orchard.kvcache.wire import KNOWN_VERSIONS, KVBlockData, decode_blocks, encode_blocks

DTYPES = ["float32", "float16", "bfloat16"]


def tiny_geometry(dtype: str = "float16", **changes) -> KVGeometry:
    geometry = KVGeometry("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    return dataclasses.replace(geometry, **changes)


def random_block_arrays(geometry: KVGeometry, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    unsigned = np.dtype(f"uint{8 * geometry.itemsize}")
    shape = (geometry.num_layers, *geometry.block_shape)
    return rng.integers(0, np.iinfo(unsigned).max, size=shape, dtype=unsigned).view(geometry.numpy_storage_dtype)


def make_blocks(geometry: KVGeometry, n: int = 3) -> list[KVBlockData]:
    tokens = list(range(100, 100 + n * geometry.block_size))
    hashes = block_hashes(tokens, geometry.block_size, root_hash(geometry.model_fingerprint))
    parents = [None, *hashes[:-1]]
    return [
        KVBlockData(
            block_hash=hashes[i],
            parent_hash=parents[i],
            token_ids=tuple(tokens[i * geometry.block_size : (i + 1) * geometry.block_size]),
            keys=random_block_arrays(geometry, 2 * i),
            values=random_block_arrays(geometry, 2 * i + 1),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dtype):
    geometry = tiny_geometry(dtype)
    blocks = make_blocks(geometry)
    decoded = decode_blocks(encode_blocks(geometry, blocks), geometry)
    assert len(decoded) == 3
    for sent, got in zip(blocks, decoded):
        assert got.block_hash == sent.block_hash and got.parent_hash == sent.parent_hash
        assert got.token_ids == sent.token_ids
        assert got.keys.dtype == geometry.numpy_storage_dtype and got.keys.shape == (2, 4, 2, 8)
        assert got.keys.tobytes() == sent.keys.tobytes()
        assert got.values.tobytes() == sent.values.tobytes()


def test_decoded_arrays_are_views_of_the_payload_not_copies():
    geometry = tiny_geometry("float32")
    decoded = decode_blocks(encode_blocks(geometry, make_blocks(geometry, 1)), geometry)
    assert not decoded[0].keys.flags.owndata
    assert not decoded[0].keys.flags.writeable


def test_empty_block_list_round_trips():
    geometry = tiny_geometry()
    assert decode_blocks(encode_blocks(geometry, []), geometry) == []


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_fingerprint": "another-model"}, "model_fingerprint"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"block_size": 8}, "block_size"),
        ({"num_layers": 3}, "num_layers"),
        ({"num_kv_heads": 1, "head_dim": 16}, "num_kv_heads"),
    ],
)
def test_payload_for_another_geometry_is_refused_naming_the_field(change, field):
    sender = tiny_geometry()
    payload = encode_blocks(sender, make_blocks(sender, 1))
    receiver = dataclasses.replace(sender, **change)
    with pytest.raises(IncompatibleKVPayload) as refused:
        decode_blocks(payload, receiver)
    assert str(refused.value).endswith(f"{field}: expected {getattr(receiver, field)!r}, got {getattr(sender, field)!r}")


def test_another_format_version_is_refused_as_incompatible():
    geometry = tiny_geometry()
    envelope = msgpack.unpackb(encode_blocks(geometry, make_blocks(geometry, 1)))
    envelope["version"] = max(KNOWN_VERSIONS) + 1
    with pytest.raises(IncompatibleKVPayload, match=r"format version: expected one of \(1, 2\), got 3"):
        decode_blocks(msgpack.packb(envelope), geometry)


def test_a_flipped_byte_in_the_kv_bytes_fails_the_checksum():
    geometry = tiny_geometry()
    payload = bytearray(encode_blocks(geometry, make_blocks(geometry)))
    payload[len(payload) // 2] ^= 0x01
    with pytest.raises(CorruptKVPayload, match="checksum mismatch"):
        decode_blocks(bytes(payload), geometry)


def test_a_flipped_byte_in_the_checksum_itself_is_caught():
    geometry = tiny_geometry()
    payload = bytearray(encode_blocks(geometry, make_blocks(geometry)))
    payload[-1] ^= 0x80
    with pytest.raises(CorruptKVPayload, match="checksum mismatch"):
        decode_blocks(bytes(payload), geometry)


@pytest.mark.parametrize("keep", [0, 10, 100, -1])
def test_truncated_payload_is_refused_as_corrupt(keep):
    geometry = tiny_geometry()
    payload = encode_blocks(geometry, make_blocks(geometry))
    with pytest.raises(CorruptKVPayload):
        decode_blocks(payload[:keep], geometry)


def test_trailing_bytes_after_the_envelope_are_refused():
    geometry = tiny_geometry()
    payload = encode_blocks(geometry, make_blocks(geometry, 1))
    with pytest.raises(CorruptKVPayload, match="not a whole msgpack envelope"):
        decode_blocks(payload + b"\x00", geometry)


@pytest.mark.parametrize("garbage", [b"\xc1" * 64, b"hello, this is not KV at all!", msgpack.packb({"a": 1} | {"b": b"x" * 30})])
def test_garbage_is_refused_as_corrupt(garbage):
    with pytest.raises(CorruptKVPayload):
        decode_blocks(garbage, tiny_geometry())


def _resealed(envelope: dict) -> bytes:
    """Re-encode a tampered envelope with a valid checksum, as a buggy sender would."""
    import xxhash

    payload = bytearray(msgpack.packb(envelope))
    payload[-16:] = xxhash.xxh3_128_digest(bytes(payload[:-16]))
    return bytes(payload)


def test_a_block_with_short_kv_bytes_is_refused_even_with_a_valid_checksum():
    geometry = tiny_geometry()
    envelope = msgpack.unpackb(encode_blocks(geometry, make_blocks(geometry, 2)))
    envelope["blocks"][1]["v"] = envelope["blocks"][1]["v"][:-2]
    with pytest.raises(CorruptKVPayload, match=r"block 1 V bytes: expected 256, got 254"):
        decode_blocks(_resealed(envelope), geometry)


def test_a_block_with_too_many_tokens_is_refused_even_with_a_valid_checksum():
    geometry = tiny_geometry()
    envelope = msgpack.unpackb(encode_blocks(geometry, make_blocks(geometry, 1)))
    envelope["blocks"][0]["tokens"] = [1, 2, 3, 4, 5]
    with pytest.raises(CorruptKVPayload, match=r"block 0 token count: expected 1..4, got 5"):
        decode_blocks(_resealed(envelope), geometry)


def test_encode_refuses_arrays_that_do_not_match_the_geometry():
    geometry = tiny_geometry("float16")
    block = make_blocks(geometry, 1)[0]
    with pytest.raises(ValueError, match="dtype"):
        encode_blocks(geometry, [dataclasses.replace(block, keys=block.keys.astype(np.float32))])
    with pytest.raises(ValueError, match="shape"):
        encode_blocks(geometry, [dataclasses.replace(block, values=block.values[:1])])
