"""The wire format written as pieces and read as views is the very format `orchard.kvcache.wire` defines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import hash_block, root_hash
from orchard.kvcache.wire import KVBlockData, decode_blocks, encode_blocks
from orchard.kvcache.wire_stream import BlockPieces, decode_views
from tests.kvcache.wire_pieces import encode_pieces

GEOMETRY = KVGeometry("fp", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def blocks(n: int = 20) -> list[KVBlockData]:
    """`n` chained blocks (enough for msgpack's 16-entry array form), the last one partly filled."""
    rng = np.random.default_rng(0)
    parent, out = root_hash("fp"), []
    for i in range(n):
        tokens = tuple(range(i * 300, i * 300 + (4 if i < n - 1 else 3)))  # ids past 255 and 65535 packed wider
        tokens = tuple(t * 257 for t in tokens)
        k, v = (rng.standard_normal((3, 4, 2, 8)).astype(np.float16) for _ in range(2))
        block_hash = hash_block(parent, tokens)
        out.append(KVBlockData(block_hash, parent if i else None, tokens, k, v))
        parent = block_hash
    return out


def as_pieces(data: list[KVBlockData]) -> list[BlockPieces]:
    return [BlockPieces(b.block_hash, b.parent_hash, b.token_ids, list(b.keys), list(b.values)) for b in data]


def test_pieces_are_a_payload_decode_blocks_reads_as_the_same_blocks():
    data = blocks()
    payload = b"".join(bytes(p) for p in encode_pieces(GEOMETRY, as_pieces(data)))
    for ours, theirs in zip(decode_blocks(payload, GEOMETRY), data, strict=True):
        assert (ours.block_hash, ours.parent_hash, ours.token_ids) == (theirs.block_hash, theirs.parent_hash, theirs.token_ids)
        assert np.array_equal(ours.keys, theirs.keys) and np.array_equal(ours.values, theirs.values)


def test_full_blocks_lie_equally_spaced_so_a_pool_takes_them_as_one_strided_run():
    from orchard.kvcache.pool import _as_run

    data = blocks()[:-1]  # token ids of 1 to 3 bytes in msgpack's narrowest forms; all full
    views = decode_views(bytearray(b"".join(bytes(p) for p in encode_pieces(GEOMETRY, as_pieces(data)))), GEOMETRY)
    run = _as_run([v.keys for v in views])
    assert run is not None and np.array_equal(run, np.stack([b.keys for b in data]))


def test_views_read_what_decode_blocks_reads_without_copying():
    payload = bytearray(encode_blocks(GEOMETRY, blocks()))
    views, decoded = decode_views(payload, GEOMETRY), decode_blocks(bytes(payload), GEOMETRY)
    for view, block in zip(views, decoded, strict=True):
        assert (view.block_hash, view.parent_hash, view.token_ids) == (block.block_hash, block.parent_hash, block.token_ids)
        assert np.array_equal(view.keys, block.keys) and np.array_equal(view.values, block.values)
    assert np.shares_memory(views[0].keys, np.frombuffer(payload, dtype=np.uint8))


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_damaged_bytes_are_refused(damage):
    payload = bytearray(encode_blocks(GEOMETRY, blocks()))
    if damage == "flip":
        payload[len(payload) // 3] ^= 1
    elif damage == "truncate":
        del payload[-40:]
    else:
        payload += b"\0"
    with pytest.raises(CorruptKVPayload):
        decode_views(payload, GEOMETRY)


def test_a_payload_of_another_model_is_incompatible():
    payload = encode_blocks(replace(GEOMETRY, model_fingerprint="other"), blocks(3))
    with pytest.raises(IncompatibleKVPayload, match="model_fingerprint"):
        decode_views(payload, GEOMETRY)
