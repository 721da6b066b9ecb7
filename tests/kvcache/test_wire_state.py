"""A hybrid model's payload carries the recurrent state after its last block (format version 2),
read alike by both decoders, covered by the checksum, and refused whenever it does not fit."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import StateArray, StateGeometry
from orchard.kvcache.wire import (
    FORMAT_VERSION,
    STATE_FORMAT_VERSION,
    StateSnapshotData,
    decode_blocks,
    decode_payload,
    encode_blocks,
)
from orchard.kvcache.wire_stream import decode_payload_views, decode_views
from tests.kvcache.test_wire import make_blocks, tiny_geometry
from tests.kvcache.test_wire_stream import as_pieces
from tests.kvcache.wire_pieces import encode_pieces

GEOMETRY = tiny_geometry("float16")
STATE = StateGeometry((
    (StateArray((3, 16), "bfloat16"), StateArray((2, 4, 4), "float32")),
    (StateArray((3, 16), "bfloat16"), StateArray((2, 4, 4), "float32")),
))


def state_after(blocks, geometry: StateGeometry = STATE, seed: int = 7) -> StateSnapshotData:
    rng = np.random.default_rng(seed)
    arrays = [[random_bits(rng, a) for a in layer] for layer in geometry.layers]
    return StateSnapshotData(blocks[-1].block_hash, geometry, arrays)


def random_bits(rng, spec: StateArray) -> np.ndarray:
    unsigned = np.dtype(f"uint{8 * spec.numpy_storage_dtype.itemsize}")
    return rng.integers(0, np.iinfo(unsigned).max, size=spec.shape, dtype=unsigned).view(spec.numpy_storage_dtype)


def both_encodings(blocks, state) -> dict[str, bytes]:
    return {"encode_blocks": encode_blocks(GEOMETRY, blocks, state),
            "encode_pieces": b"".join(bytes(p) for p in encode_pieces(GEOMETRY, as_pieces(blocks), state))}


DECODERS = {
    "decode_payload": lambda payload, state: decode_payload(bytes(payload), GEOMETRY, state),
    "decode_payload_views": lambda payload, state: decode_payload_views(bytearray(payload), GEOMETRY, state),
}


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("encoder", ["encode_blocks", "encode_pieces"])
def test_the_state_after_the_last_block_round_trips_bit_for_bit(encoder, decoder):
    blocks = make_blocks(GEOMETRY, 3)
    state = state_after(blocks)
    decoded = DECODERS[decoder](both_encodings(blocks, state)[encoder], STATE)
    assert [b.block_hash for b in decoded.blocks] == [b.block_hash for b in blocks]
    assert decoded.state.block_hash == blocks[-1].block_hash and decoded.state.geometry == STATE
    for mine, theirs in zip(decoded.state.arrays, state.arrays, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_payload_without_state_is_version_1_and_one_with_state_version_2():
    blocks = make_blocks(GEOMETRY, 2)
    plain = msgpack.unpackb(encode_blocks(GEOMETRY, blocks))
    hybrid = msgpack.unpackb(encode_blocks(GEOMETRY, blocks, state_after(blocks)))
    assert (plain["version"], list(plain)) == (FORMAT_VERSION, ["format", "version", "geometry", "blocks", "checksum"])
    assert (hybrid["version"], list(hybrid)) == (STATE_FORMAT_VERSION,
                                                 ["format", "version", "geometry", "blocks", "state", "checksum"])


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("change", ["layer count", "shape", "dtype", "array count"])
def test_a_state_of_another_geometry_is_refused(decoder, change):
    theirs = {
        "layer count": StateGeometry(STATE.layers[:1]),
        "shape": StateGeometry((STATE.layers[0], (STATE.layers[1][0], StateArray((2, 4, 5), "float32")))),
        "dtype": StateGeometry((STATE.layers[0], (STATE.layers[1][0], StateArray((2, 4, 4), "float16")))),
        "array count": StateGeometry((STATE.layers[0], STATE.layers[1][:1])),
    }[change]
    blocks = make_blocks(GEOMETRY, 2)
    payload = encode_blocks(GEOMETRY, blocks, state_after(blocks, theirs))
    with pytest.raises(IncompatibleKVPayload, match="recurrent state is for another state pool: state layer"):
        DECODERS[decoder](payload, STATE)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_blocks_without_a_state_are_refused_by_a_hybrid_decoder(decoder):
    payload = encode_blocks(GEOMETRY, make_blocks(GEOMETRY, 2))
    with pytest.raises(IncompatibleKVPayload, match="no recurrent state"):
        DECODERS[decoder](payload, STATE)
    assert DECODERS[decoder](encode_blocks(GEOMETRY, []), STATE).blocks == []  # nothing to resume: nothing refused


@pytest.mark.parametrize("decoder", [decode_blocks, decode_views])
def test_a_state_is_refused_by_a_model_without_one(decoder):
    blocks = make_blocks(GEOMETRY, 2)
    with pytest.raises(IncompatibleKVPayload, match="carries a recurrent state"):
        decoder(encode_blocks(GEOMETRY, blocks, state_after(blocks)), GEOMETRY)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_a_damaged_or_cut_state_fails_the_checksum(decoder):
    blocks = make_blocks(GEOMETRY, 2)
    payload = encode_blocks(GEOMETRY, blocks, state_after(blocks))
    damaged = bytearray(payload)
    damaged[-40] ^= 0x01  # inside the last state array, before the checksum
    for broken in (bytes(damaged), payload[:-200]):
        with pytest.raises(CorruptKVPayload):
            DECODERS[decoder](broken, STATE)


def test_a_state_is_written_only_after_the_block_it_belongs_to():
    blocks = make_blocks(GEOMETRY, 3)
    misplaced = dataclasses.replace(state_after(blocks), block_hash=blocks[0].block_hash)
    with pytest.raises(ValueError, match="after the block it belongs to"):
        encode_blocks(GEOMETRY, blocks, misplaced)
    with pytest.raises(ValueError, match="after the block it belongs to"):
        encode_pieces(GEOMETRY, as_pieces(blocks), misplaced)
