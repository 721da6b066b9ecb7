"""Compressed frames (`orchard.kvcache.wire_compressed`): a payload comes out bit for bit, in every
KV dtype and wire version; damaged, cut-off, unknown and oversized frames are refused before
anything is inflated or read; a frame holding another model's payload is refused as that payload
would be."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
import xxhash
import zstandard

from orchard.kvcache import wire_compressed
from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.wire import BlockRun
from orchard.kvcache.wire_layers import layer_pieces
from orchard.kvcache.wire_stream import payload_pieces
from orchard.kvcache.wire_transit import IncomingPayload, OutgoingPayload
from tests.kvcache.test_wire_layers import chunk
from tests.kvcache.test_wire_stream import GEOMETRY as BLOCK_GEOMETRY
from tests.kvcache.test_wire_stream import as_pieces, blocks

LAYERS = KVGeometry("fp", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", value_head_dim=6)
LIMIT = 1 << 20


def sent(pieces: list) -> bytes:
    """What the link's sender puts on the wire for `pieces` (all but the last checksum)."""
    outgoing = OutgoingPayload(pieces)
    return b"".join(bytes(p) for batch in outgoing.batches(4096, 8) for p in batch) + outgoing.checksum()


def landed(frame: bytes, geometry: KVGeometry, limit: int = LIMIT):
    incoming = IncomingPayload(bytearray(frame))
    incoming.landed(len(frame))
    return incoming.decode(geometry, None, limit), incoming


def layer_chunk(dtype: str):
    """A layer-major chunk of `dtype` KV (bfloat16 as its uint16 storage) and its K."""
    c, keys, _ = chunk()
    geometry = replace(LAYERS, dtype=dtype)
    storage = geometry.numpy_storage_dtype
    rng = np.random.default_rng(7)
    k = rng.standard_normal(keys.shape).astype(np.float32)
    v = rng.standard_normal((3, len(keys[0]), 4, 2, 6)).astype(np.float32)
    as_storage = (lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)) if dtype == "bfloat16" else (lambda a: a.astype(storage))
    k, v = as_storage(k), as_storage(v)
    return replace(c, keys=list(k), values=list(v)), geometry, k, v


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_layer_major_chunk_comes_out_of_its_frame_bit_for_bit_and_smaller(dtype):
    c, geometry, keys, values = layer_chunk(dtype)
    plain = layer_pieces(geometry, c)
    frame = sent(wire_compressed.compressed_pieces(plain, geometry.itemsize))
    payload, incoming = landed(frame, geometry)
    assert isinstance(payload.blocks, BlockRun)
    assert payload.blocks.keys.tobytes() == np.ascontiguousarray(keys.swapaxes(0, 1)).tobytes()
    assert payload.blocks.values.tobytes() == np.ascontiguousarray(values.swapaxes(0, 1)).tobytes()
    assert payload.blocks.hashes.tobytes() == c.hashes.tobytes()
    plain_size = len(sent(plain))
    assert incoming.payload_size == plain_size  # the payload inflated, its own checksum included
    assert len(frame) < plain_size


def test_a_block_by_block_payload_comes_out_of_its_frame_as_decode_views_reads_it():
    made = blocks(3)
    frame = sent(wire_compressed.compressed_pieces(payload_pieces(BLOCK_GEOMETRY, as_pieces(made)), BLOCK_GEOMETRY.itemsize))
    payload, _ = landed(frame, BLOCK_GEOMETRY)
    assert [b.block_hash for b in payload.blocks] == [b.block_hash for b in made]
    for got, want in zip(payload.blocks, made):
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("size", [1, 7, 4096 + 3])
def test_byte_planes_are_undone_exactly_whatever_the_bytes_past_the_last_whole_element(width, size):
    data = bytearray(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    assert wire_compressed._interleaved(wire_compressed._planes(data, width), width) == data


def frame_of(dtype: str = "float16") -> tuple[bytes, KVGeometry]:
    c, geometry, _, _ = layer_chunk(dtype)
    return sent(wire_compressed.compressed_pieces(layer_pieces(geometry, c), geometry.itemsize)), geometry


@pytest.mark.parametrize("where", [0, 5, wire_compressed.HEADER_SIZE + 3, -20, -1])
def test_a_frame_damaged_anywhere_is_refused_by_its_checksum(where):
    frame, geometry = frame_of()
    damaged = bytearray(frame)
    damaged[where] ^= 0x10
    with pytest.raises(CorruptKVPayload, match="checksum"):
        landed(bytes(damaged), geometry)


def resealed(frame: bytes, header: bytes | None = None, body: bytes | None = None) -> bytes:
    """`frame` with its header or body replaced and a checksum that matches them: what only a
    peer that means it could send."""
    head = frame[: wire_compressed.HEADER_SIZE] if header is None else header
    inner = frame[wire_compressed.HEADER_SIZE : -16] if body is None else body
    return head + inner + xxhash.xxh3_128_digest(head + inner)


def header(size: int, version: int = wire_compressed.VERSION, width: int = 2) -> bytes:
    return struct.pack(">4sBBQ", wire_compressed.MAGIC, version, width, size)


def test_a_frame_whose_size_is_past_the_readers_limit_is_refused_before_it_inflates(monkeypatch):
    frame, geometry = frame_of()
    size = struct.unpack(">Q", frame[6:14])[0]
    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", lambda *a, **k: pytest.fail("inflated"))
    with pytest.raises(CorruptKVPayload, match="past this reader's limit"):
        landed(frame, geometry, limit=size - 1)
    with pytest.raises(CorruptKVPayload, match="past this reader's limit"):
        landed(frame, geometry, limit=0)  # a reader that asked for none


def test_a_small_frame_that_claims_a_huge_payload_is_refused_without_inflating(monkeypatch):
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", lambda *a, **k: pytest.fail("inflated"))
    with pytest.raises(CorruptKVPayload, match="past this reader's limit"):
        landed(resealed(frame_of()[0], header(64 << 20), bomb), LAYERS)
    with pytest.raises(CorruptKVPayload, match="size differs"):  # a header that understates it
        landed(resealed(frame_of()[0], header(1000), bomb), LAYERS)


@pytest.mark.parametrize("bad", [{"version": 2}, {"width": 3}])
def test_a_frame_of_an_unknown_version_or_width_is_refused(bad):
    frame, geometry = frame_of()
    with pytest.raises(CorruptKVPayload, match="not one this reader knows"):
        landed(resealed(frame, header(100, **bad)), geometry)


def test_a_cut_off_frame_is_refused():
    frame, geometry = frame_of()
    with pytest.raises(CorruptKVPayload):
        landed(resealed(frame, body=frame[wire_compressed.HEADER_SIZE : -200]), geometry)
    with pytest.raises(CorruptKVPayload, match="too short"):
        landed(frame[:10], geometry)


def test_a_frame_of_another_models_payload_is_refused_as_the_payload_would_be():
    frame, geometry = frame_of()
    with pytest.raises(IncompatibleKVPayload):
        landed(frame, replace(geometry, model_fingerprint="another"))


def test_a_payload_is_never_taken_for_a_frame():
    c, geometry, _, _ = layer_chunk("float16")
    assert not wire_compressed.is_compressed(sent(layer_pieces(geometry, c)))
    assert wire_compressed.MAGIC[0] == 0xC1  # msgpack never writes 0xc1: no payload starts with it
