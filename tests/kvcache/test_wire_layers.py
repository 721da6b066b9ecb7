"""Wire format version 3 (layer-major chunks): exact round trip, the same checks as version 2, and
readers of versions 1 and 2 refusing it by the version check."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import xxhash

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry, StateArray, StateGeometry
from orchard.kvcache.hashing import hash_block, root_hash
from orchard.kvcache.wire import BlockRun, decode_payload
from orchard.kvcache.wire_layers import LayerChunk, chunk_layout, layer_pieces, layout_of_size, read_views
from orchard.kvcache.wire_stream import decode_payload_views
from orchard.kvcache.wire_transit import IncomingPayload, OutgoingPayload

GEOMETRY = KVGeometry("fp", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", value_head_dim=6)


def chunk(n: int = 5) -> tuple[LayerChunk, np.ndarray, np.ndarray]:
    """A chunk of `n` chained full blocks and its K/V as `[num_layers, n, ...]` arrays."""
    rng = np.random.default_rng(1)
    parent, hashes, parents, tokens = root_hash("fp"), [], [], []
    for i in range(n):
        ids = tuple(70000 * i + j for j in range(4))
        block_hash = hash_block(parent, ids)
        hashes.append(bytes(block_hash)), parents.append(bytes(parent)), tokens.append(ids)
        parent = block_hash
    keys = rng.standard_normal((3, n, 4, 2, 8)).astype(np.float16)
    values = rng.standard_normal((3, n, 4, 2, 6)).astype(np.float16)
    rows = lambda b: np.frombuffer(b"".join(b), np.uint8).reshape(n, 16)  # noqa: E731
    return LayerChunk(rows(hashes), rows(parents), np.array(tokens, np.uint32), list(keys), list(values)), keys, values


def payload(c: LayerChunk, geometry: KVGeometry = GEOMETRY) -> bytes:
    body = b"".join(bytes(p) for p in layer_pieces(geometry, c))
    return body + xxhash.xxh3_128_digest(body)


def read(data: bytes, geometry: KVGeometry = GEOMETRY, state=None):
    view = memoryview(bytearray(data))
    return read_views(view, xxhash.xxh3_128_digest(view[:-16]), geometry, state)


def test_a_layer_major_chunk_reads_back_as_the_exact_blocks_and_arrays():
    c, keys, values = chunk()
    run = read(payload(c)).blocks
    assert isinstance(run, BlockRun) and len(run) == 5 and run.is_chained()
    assert run.hashes.tobytes() == c.hashes.tobytes() and run.parents.tobytes() == c.parents.tobytes()
    assert run.tokens.tolist() == c.tokens.tolist()
    assert run.keys.shape == (5, 3, 4, 2, 8) and run.values.shape == (5, 3, 4, 2, 6)
    assert np.array_equal(run.keys, keys.transpose(1, 0, 2, 3, 4)) and np.array_equal(run.values, values.transpose(1, 0, 2, 3, 4))
    assert run[2].token_ids == (140000, 140001, 140002, 140003)


def test_the_layer_major_bytes_are_pinned():
    c, keys, values = chunk(2)
    data = payload(c)
    assert data[:1] == b"\x85" and b"\xa7version\x03" in data
    k0, v0 = keys[0].tobytes(), values[0].tobytes()
    assert (len(k0), len(v0)) == (256, 192)  # bin16 and bin8 headers
    layer0 = b"\xa6layers\x96" + b"\xc5\x01\x00" + k0 + b"\xc4\xc0" + v0 + b"\xc5\x01\x00" + keys[1].tobytes()
    assert layer0 in data


def test_a_payload_landed_in_slices_decodes_layer_major():
    c, keys, _ = chunk()
    data = payload(c)
    incoming = IncomingPayload(bytearray(len(data)))
    for start in range(0, len(data), 100):
        incoming.data[start : start + 100] = data[start : start + 100]
        incoming.landed(min(len(data), start + 100))
    assert np.array_equal(incoming.decode(GEOMETRY).blocks.keys[:, 1], keys[1])


def test_the_sender_puts_the_bytes_of_layer_pieces_and_their_checksum_on_the_wire():
    c, _, _ = chunk()
    outgoing = OutgoingPayload(layer_pieces(GEOMETRY, c))
    sent = [bytes(p) for batch in outgoing.batches(256, 3) for p in batch]
    assert b"".join(sent) + outgoing.checksum() == payload(c)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_a_payloads_size_tells_its_blocks_and_where_each_part_lies(n):
    """The layout a receiver works out from a payload's size alone is the one `layer_pieces` wrote:
    its size, its head up to the first K header, and every layer's K and V at their offsets."""
    c, keys, values = chunk(n)
    data = payload(c)
    layout = layout_of_size(GEOMETRY, len(data))
    assert layout is not None and layout.n == n and layout.size == len(data)
    hashes, parents, tokens = layout.read_meta(memoryview(data)[: layout.meta_size])
    assert (hashes.tobytes(), parents.tobytes(), tokens.tolist()) == (c.hashes.tobytes(), c.parents.tobytes(), c.tokens.tolist())
    at = layout.meta_size
    for layer in range(GEOMETRY.num_layers):
        at += len(layout.key_header)
        assert data[at : at + layout.key_bytes] == keys[layer].tobytes()
        at += layout.key_bytes + len(layout.value_header)
        assert data[at : at + layout.value_bytes] == values[layer].tobytes()
        at += layout.value_bytes
    assert at == len(data) - 27  # the checksum's field name, its header and its 16 bytes


def test_sizes_no_number_of_blocks_makes_have_no_layout_across_every_header_width():
    """Past 255 and 65,535 bytes a header widens: every n through both still maps back from its size
    alone, and no size near one maps to any other n."""
    geometry = KVGeometry("fp", num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype="float16")
    sizes = {chunk_layout(geometry, n).size: n for n in range(1, 4200)}
    assert sorted(sizes) == [chunk_layout(geometry, n).size for n in range(1, 4200)]  # strictly growing
    for size in {size + off for size in sizes for off in range(-3, 4)}:
        layout = layout_of_size(geometry, size)
        assert (layout.n if layout is not None else None) == sizes.get(size)


def test_another_models_head_is_not_read_as_this_layouts():
    c, _, _ = chunk()
    data = payload(c, replace(GEOMETRY, model_fingerprint="another"))
    layout = chunk_layout(GEOMETRY, 5)
    assert layout.read_meta(memoryview(data)[: layout.meta_size]) is None


def test_readers_of_versions_one_and_two_refuse_version_three_by_the_version_check():
    data = payload(chunk()[0])
    with pytest.raises(IncompatibleKVPayload, match="format version"):
        decode_payload(data, GEOMETRY)
    with pytest.raises(IncompatibleKVPayload, match="format version"):
        decode_payload_views(bytearray(data), GEOMETRY)


def test_a_foreign_model_is_refused():
    data = payload(chunk()[0])
    with pytest.raises(IncompatibleKVPayload, match="another model"):
        read(data, replace(GEOMETRY, model_fingerprint="other"))


def test_a_hybrid_model_refuses_a_layer_major_payload():
    state = StateGeometry(((StateArray((2, 3), "float32"),),))
    with pytest.raises(IncompatibleKVPayload, match="recurrent state"):
        read(payload(chunk()[0]), GEOMETRY, state)


@pytest.mark.parametrize("where", [40, -200, -20])
def test_a_damaged_byte_is_refused_by_the_checksum(where):
    data = bytearray(payload(chunk()[0]))
    data[where] ^= 1
    incoming = IncomingPayload(bytearray(data))
    incoming.landed(len(data))
    with pytest.raises(CorruptKVPayload, match="checksum"):
        incoming.decode(GEOMETRY)


def test_a_truncated_payload_is_refused():
    data = payload(chunk()[0])
    incoming = IncomingPayload(bytearray(len(data)))
    incoming.data[: len(data) - 50] = data[:-50]
    incoming.landed(len(data) - 50)
    with pytest.raises(CorruptKVPayload, match="ends after"):
        incoming.decode(GEOMETRY)
    short = data[:-300]
    with pytest.raises(CorruptKVPayload):
        read(short[:-16] + xxhash.xxh3_128_digest(short[:-16]))


def test_a_well_checksummed_payload_with_a_layer_too_few_is_refused():
    c, _, _ = chunk()
    body = b"".join(bytes(p) for p in layer_pieces(GEOMETRY, c))
    body = body.replace(b"\xa6layers\x96", b"\xa6layers\x94")
    with pytest.raises(CorruptKVPayload):
        read(body + xxhash.xxh3_128_digest(body))


def test_a_chunk_of_wrong_sizes_is_not_encoded():
    c, _, _ = chunk()
    with pytest.raises(ValueError):
        layer_pieces(GEOMETRY, replace(c, keys=c.keys[:2]))
    with pytest.raises(ValueError):
        layer_pieces(GEOMETRY, replace(c, tokens=c.tokens[:, :3]))
