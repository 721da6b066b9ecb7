"""A payload checksummed while it moves: the bytes sent are `encode_pieces`'s, and a payload
received in slices is refused, as `decode_views` refuses it, unless every byte landed intact."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.wire_stream import decode_views, payload_pieces
from orchard.kvcache.wire_transit import IncomingPayload, OutgoingPayload
from tests.kvcache.test_wire_stream import GEOMETRY, as_pieces, blocks
from tests.kvcache.wire_pieces import encode_pieces


def encoded(n: int = 20) -> bytes:
    return b"".join(bytes(p) for p in encode_pieces(GEOMETRY, as_pieces(blocks(n))))


def land(payload: bytes, slice_bytes: int, upto: int | None = None) -> IncomingPayload:
    """`payload` landed in `slices_bytes` slices into a buffer of its size (up to `upto` of it)."""
    incoming = IncomingPayload(bytearray(len(payload)))
    end = len(payload) if upto is None else upto
    for start in range(0, end, slice_bytes):
        stop = min(end, start + slice_bytes)
        incoming.data[start:stop] = payload[start:stop]
        incoming.landed(stop)
    return incoming


@pytest.mark.parametrize("max_bytes, max_pieces", [(1, 1), (100, 3), (1 << 20, 512)])
def test_batches_then_the_checksum_are_the_bytes_encode_pieces_makes(max_bytes, max_pieces):
    outgoing = OutgoingPayload(payload_pieces(GEOMETRY, as_pieces(blocks())))
    sent = []
    for batch in outgoing.batches(max_bytes, max_pieces):
        assert len(batch) <= max_pieces and (len(batch) == 1 or sum(map(len, batch)) <= max_bytes)
        sent += batch
    sent.append(outgoing.checksum())
    assert b"".join(bytes(p) for p in sent) == encoded() and outgoing.size == len(encoded())


def test_the_checksum_is_not_given_before_every_piece_was_handed_out():
    outgoing = OutgoingPayload(payload_pieces(GEOMETRY, as_pieces(blocks())))
    next(outgoing.batches(64, 2))
    with pytest.raises(RuntimeError):
        outgoing.checksum()


@pytest.mark.parametrize("slice_bytes", [1, 7, 4096, 1 << 20])
def test_a_payload_landed_in_slices_reads_as_decode_views_reads_it(slice_bytes):
    payload = encoded()
    ours, theirs = land(payload, slice_bytes).decode(GEOMETRY).blocks, decode_views(bytearray(payload), GEOMETRY)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.block_hash, a.parent_hash, a.token_ids) == (b.block_hash, b.parent_hash, b.token_ids)
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)


@pytest.mark.parametrize("where", ["kv", "header", "checksum"])
def test_a_byte_damaged_on_the_way_is_refused(where):
    payload = bytearray(encoded())
    at = {"kv": len(payload) // 2, "header": 3, "checksum": len(payload) - 1}[where]
    payload[at] ^= 0x10
    with pytest.raises(CorruptKVPayload, match="checksum"):
        land(bytes(payload), 4096).decode(GEOMETRY)


def test_a_payload_not_all_landed_is_refused_and_bytes_land_in_order():
    payload = encoded()
    with pytest.raises(CorruptKVPayload, match="ends after"):
        land(payload, 4096, upto=len(payload) - 20).decode(GEOMETRY)
    incoming = land(payload, 4096, upto=100)
    with pytest.raises(ValueError):
        incoming.landed(50)
    with pytest.raises(ValueError):
        incoming.landed(len(payload) + 1)


def test_a_payload_too_short_to_hold_a_checksum_is_refused():
    with pytest.raises(CorruptKVPayload, match="too short"):
        land(bytes(10), 4).decode(GEOMETRY)


def test_a_payload_of_another_model_landed_in_slices_is_incompatible():
    other = replace(GEOMETRY, model_fingerprint="other")
    payload = b"".join(bytes(p) for p in encode_pieces(other, as_pieces(blocks(3))))
    with pytest.raises(IncompatibleKVPayload, match="model_fingerprint"):
        land(payload, 512).decode(GEOMETRY)


def test_the_checksum_is_the_xxh3_128_every_release_of_xxhash_computes():
    """Nodes on different installs must agree on a payload's checksum: xxhash 4.1 picks SSE2, AVX2 or AVX-512 at
    run time where 3.x ran SSE2 alone. Pinned: the xxh3_128 of no bytes (xxHash's own test vector) and of 1 MiB,
    which takes the vectorized path, taken batch by batch as a sender takes it."""
    assert OutgoingPayload([]).checksum().hex() == "99aa06d3014798d86001c324468d497f"
    data = memoryview(bytes(range(256)) * 4099)
    outgoing = OutgoingPayload([data[i : i + 10_000] for i in range(0, len(data), 10_000)])
    assert sum(1 for _ in outgoing.batches(64 << 10, 16)) > 1
    assert outgoing.checksum().hex() == "3eb413071bb36356ebd7da7da24295f8"
