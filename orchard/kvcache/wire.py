"""The block wire format: how KV blocks travel between nodes and into files.

One msgpack map, keys in a fixed order: format tag, format version, the sender's full
geometry, the blocks (hash, parent hash, token ids, K bytes, V bytes for every layer),
for a hybrid model the recurrent state after the last block (version 2, below), and last
a 16-byte xxh3_128 checksum. The checksum covers every byte of the payload
before its own 16 bytes, so it is verified on the raw bytes before anything is
unpacked or trusted. A decoder that finds anything unexpected raises and hands back
nothing: a payload is imported whole or not at all.

Version 1 carries blocks only. Version 2 adds a `state` key after the blocks: a hybrid
model's KV cannot resume a sequence without the recurrent state of its linear-attention
layers at the last block, so the state snapshot keyed by that block's hash travels with
it, together with its geometry (per state layer, each array's shape and dtype) and its
raw bytes. A decoder whose state pool differs refuses it, as it refuses a foreign KV
geometry; a hybrid decoder refuses blocks that come without a state, and a decoder
without a state pool refuses a state.

Version 3 (`orchard.kvcache.wire_layers`) lays a link's chunk of full blocks out layer by layer; the
readers here know versions 1 and 2 only and refuse it at the version check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.hashing import HASH_SIZE

FORMAT_TAG = "mlx-orchard/kv-blocks"
FORMAT_VERSION = 1  # blocks only
STATE_FORMAT_VERSION = 2  # blocks and the recurrent state after the last of them
KNOWN_VERSIONS = (FORMAT_VERSION, STATE_FORMAT_VERSION)
CHECKSUM_SIZE = 16


@dataclass
class KVBlockData:
    """One block's KV for every layer; `keys`/`values` are `[num_layers, block_size, heads, head_dim]`
    (values of the geometry's `value_head_dim`)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    keys: np.ndarray
    values: np.ndarray


class BlockRun(Sequence[KVBlockData]):
    """Full blocks of one payload held as columns. Per-block Python on a pull's receiving side (a
    KVBlockData, a hash check and a pool write each) took longer than moving the small demo
    model's 64 KiB blocks over loopback, so a link reads, checks and imports a chunk's blocks as
    arrays. Indexing still yields a KVBlockData, so a run reads wherever a list of blocks does.

    `hashes`, `parents`: `[n, 16]` uint8; `tokens`: `[n, block_size]` uint32; `keys`/`values`:
    `[n, num_layers, block_size, heads, its head dim]` (views into the payload where read from one).
    """

    def __init__(self, hashes: np.ndarray, parents: np.ndarray, tokens: np.ndarray, keys: np.ndarray, values: np.ndarray):
        if not len(hashes) == len(parents) == len(tokens) == len(keys) == len(values):
            raise ValueError("a block run's columns must have one row per block")
        self.hashes, self.parents, self.tokens, self.keys, self.values = hashes, parents, tokens, keys, values

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return KVBlockData(self.hashes[index].tobytes(), self.parents[index].tobytes(),
                           tuple(self.tokens[index].tolist()), self.keys[index], self.values[index])

    @classmethod
    def of(cls, blocks: Sequence[KVBlockData]) -> BlockRun:
        """Full decoded blocks (each with a parent), as the payload readers' runs hold them: columns."""
        return cls(hash_rows(b.block_hash for b in blocks), hash_rows(b.parent_hash for b in blocks),
                   token_rows(b.token_ids for b in blocks),
                   np.stack([b.keys for b in blocks]), np.stack([b.values for b in blocks]))

    def hash_list(self) -> list[bytes]:
        """The blocks' hashes as bytes, in order."""
        return row_bytes(self.hashes)

    def parent_list(self) -> list[bytes]:
        return row_bytes(self.parents)

    def is_chained(self) -> bool:
        """Whether each block's parent is the block before it (a prefix run, as a pull sends)."""
        return bool(np.array_equal(self.parents[1:], self.hashes[:-1]))


def hash_rows(hashes: Iterable[bytes]) -> np.ndarray:
    """Block hashes as a run's `[n, 16]` uint8 column (`row_bytes` undoes it)."""
    return np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, HASH_SIZE)


def token_rows(token_ids: Iterable[Sequence[int]]) -> np.ndarray:
    """Full blocks' token ids as a run's `[n, block_size]` uint32 column."""
    return np.array(list(token_ids), dtype=np.uint32)


def row_bytes(array: np.ndarray) -> list[bytes]:
    """Each row of a `[n, width]` uint8 array as bytes: one copy of the array, then a slice a row, a few
    times faster than `bytes(row)` a row, which makes an array view of each first."""
    flat, width = array.tobytes(), array.shape[1]
    return [flat[i : i + width] for i in range(0, len(flat), width)]


@dataclass
class StateSnapshotData:
    """A hybrid model's recurrent state after the block `block_hash`: `arrays[l][k]` is state layer
    l's k-th array, shaped and typed as `geometry` says (its storage dtype: bfloat16 as uint16)."""

    block_hash: bytes
    geometry: StateGeometry
    arrays: list[list[np.ndarray]]


@dataclass
class KVPayload:
    """A decoded payload: its blocks in chain order and, for a hybrid model, the state after the last."""

    blocks: Sequence[KVBlockData]  # a BlockRun where every block was read at once
    state: StateSnapshotData | None = None


def block_array_shape(geometry: KVGeometry, part: str = "keys") -> tuple[int, ...]:
    """Shape of one block's K (`part` "keys") or V ("values") across all layers."""
    block_shape = geometry.value_block_shape if part == "values" else geometry.key_block_shape
    return (geometry.num_layers, *block_shape)


def block_array_bytes(geometry: KVGeometry, part: str = "keys") -> int:
    """Bytes of one block's K (`part` "keys") or V ("values") across all layers."""
    layer_bytes = geometry.value_bytes_per_block_layer if part == "values" else geometry.key_bytes_per_block_layer
    return geometry.num_layers * layer_bytes


def wire_dtype(geometry: KVGeometry) -> np.dtype:
    """The storage dtype, pinned little-endian so bytes mean the same on every machine."""
    return geometry.numpy_storage_dtype.newbyteorder("<")


def encode_blocks(geometry: KVGeometry, blocks: list[KVBlockData], state: StateSnapshotData | None = None) -> bytes:
    """Serialize `blocks` of a model with `geometry` (and a hybrid model's `state` after the last
    of them) into one self-describing payload."""
    envelope = {
        "format": FORMAT_TAG,
        "version": FORMAT_VERSION if state is None else STATE_FORMAT_VERSION,
        "geometry": geometry.to_dict(),
        "blocks": [_encode_block(geometry, block) for block in blocks],
    }
    if state is not None:
        envelope["state"] = state_map(state, blocks)
    envelope["checksum"] = bytes(CHECKSUM_SIZE)
    payload = bytearray(msgpack.packb(envelope, use_bin_type=True))
    payload[-CHECKSUM_SIZE:] = _checksum(payload)
    return bytes(payload)


def decode_blocks(payload: bytes, expected: KVGeometry) -> list[KVBlockData]:
    """Blocks of `payload` if it was made for `expected`, a model without recurrent state.

    The arrays are read-only `np.frombuffer` views of the K/V byte strings msgpack
    unpacked, so the only copy is msgpack's own; write them into a pool, do not mutate.
    """
    return decode_payload(payload, expected).blocks


def decode_payload(payload: bytes, expected: KVGeometry, expected_state: StateGeometry | None = None) -> KVPayload:
    """Blocks and state of `payload` if it was made for `expected` and, for a hybrid model, a
    state pool of `expected_state` (None: the model keeps no recurrent state). Views as above."""
    envelope = _unpack(payload)
    version = _check_version(envelope)
    if envelope.get("checksum") != bytes(memoryview(payload)[-CHECKSUM_SIZE:]) or _checksum(payload) != envelope["checksum"]:
        raise CorruptKVPayload("KV payload checksum mismatch: the bytes were damaged on the way")
    _check_geometry(envelope.get("geometry"), expected)
    raw_blocks = envelope.get("blocks")
    if not isinstance(raw_blocks, list):
        raise CorruptKVPayload("KV payload has no block list")
    check_state_presence(version, len(raw_blocks), expected_state)
    blocks = [_decode_block(expected, raw, i) for i, raw in enumerate(raw_blocks)]
    state = None if version == FORMAT_VERSION else _decode_state(envelope.get("state"), expected_state)
    return KVPayload(blocks, state)


def state_map(state: StateSnapshotData, blocks) -> dict:
    """The `state` entry of a version 2 envelope; the arrays as buffers of their little-endian bytes."""
    if not blocks or bytes(blocks[-1].block_hash) != bytes(state.block_hash):
        raise ValueError("a state snapshot travels after the block it belongs to, as the payload's last")
    return {
        "geometry": state.geometry.to_list(),
        "hash": bytes(state.block_hash),
        "arrays": [[state_array_bytes(spec, array, index, kind) for kind, (spec, array) in enumerate(zip(specs, arrays, strict=True))]
                   for index, (specs, arrays) in enumerate(zip(state.geometry.layers, state.arrays, strict=True))],
    }


def check_state_presence(version: int, num_blocks: int, expected_state: StateGeometry | None) -> None:
    """A hybrid model takes blocks only with the state after them; a model without state takes none."""
    if version == STATE_FORMAT_VERSION and expected_state is None:
        raise IncompatibleKVPayload("KV payload carries a recurrent state, and this model keeps none")
    if version == FORMAT_VERSION and expected_state is not None and num_blocks:
        raise IncompatibleKVPayload("KV payload has no recurrent state: a hybrid model cannot resume from its blocks alone")


def check_state_geometry(raw: object, expected: StateGeometry) -> StateGeometry:
    try:
        theirs = StateGeometry.from_list(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise IncompatibleKVPayload(f"KV payload state geometry is unreadable: {err}") from err
    difference = expected.mismatch(theirs)
    if difference is not None:
        raise IncompatibleKVPayload(f"KV payload's recurrent state is for another state pool: {difference}")
    return theirs


def _checksum(payload) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(payload)[:-CHECKSUM_SIZE])


def _encode_block(geometry: KVGeometry, block: KVBlockData) -> dict:
    if not 0 < len(block.token_ids) <= geometry.block_size:
        raise ValueError(f"a block holds 1..{geometry.block_size} tokens, got {len(block.token_ids)}")
    return {
        "hash": bytes(block.block_hash),
        "parent": None if block.parent_hash is None else bytes(block.parent_hash),
        "tokens": [int(t) for t in block.token_ids],
        "k": _array_bytes(geometry, "keys", block.keys),
        "v": _array_bytes(geometry, "values", block.values),
    }


def _array_bytes(geometry: KVGeometry, name: str, array: np.ndarray) -> memoryview:
    if array.shape != block_array_shape(geometry, name):
        raise ValueError(f"block {name} have shape {array.shape}, expected {block_array_shape(geometry, name)}")
    if array.dtype != geometry.numpy_storage_dtype:
        raise ValueError(f"block {name} have dtype {array.dtype}, expected {geometry.numpy_storage_dtype}")
    contiguous = np.ascontiguousarray(array, dtype=wire_dtype(geometry))
    return memoryview(contiguous).cast("B")


def state_array_bytes(spec, array: np.ndarray, layer: int, kind: int) -> memoryview:
    """A state array's bytes as the wire and the cold tier store them (little-endian, contiguous),
    after checking it is the array `spec` describes."""
    if array.shape != spec.shape or array.dtype != spec.numpy_storage_dtype:
        raise ValueError(f"state layer {layer} array {kind} is not {spec.shape} {spec.numpy_storage_dtype} "
                         f"as expected but {array.shape} {array.dtype}")
    contiguous = np.ascontiguousarray(array, dtype=spec.numpy_storage_dtype.newbyteorder("<"))
    return memoryview(contiguous).cast("B")


def _decode_state(raw: object, expected: StateGeometry) -> StateSnapshotData:
    if not isinstance(raw, dict):
        raise CorruptKVPayload("KV payload of version 2 has no state map")
    geometry = check_state_geometry(raw.get("geometry"), expected)
    block_hash, layers = raw.get("hash"), raw.get("arrays")
    if not isinstance(block_hash, bytes):
        raise CorruptKVPayload("KV payload state hash is not bytes")
    if not isinstance(layers, list) or [len(x) if isinstance(x, list) else None for x in layers] != [len(x) for x in geometry.layers]:
        raise CorruptKVPayload("KV payload state arrays are not laid out as its geometry says")
    arrays = [[state_array_view(spec, data, index, kind) for kind, (spec, data) in enumerate(zip(specs, datas))]
              for index, (specs, datas) in enumerate(zip(geometry.layers, layers))]
    return StateSnapshotData(block_hash, geometry, arrays)


def state_array_view(spec, data, layer: int, kind: int) -> np.ndarray:
    """A state array of `spec` read in place from its wire bytes (any buffer)."""
    if not isinstance(data, (bytes, memoryview)) or len(data) != spec.nbytes:
        raise CorruptKVPayload(f"state layer {layer} array {kind} bytes: expected {spec.nbytes}, got {_length(data)}")
    view = np.frombuffer(data, dtype=spec.numpy_storage_dtype.newbyteorder("<")).reshape(spec.shape)
    return view.view(spec.numpy_storage_dtype)


def _unpack(payload: bytes) -> dict:
    if len(payload) <= CHECKSUM_SIZE:
        raise CorruptKVPayload(f"KV payload of {len(payload)} bytes is too short to hold anything")
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as err:
        raise CorruptKVPayload(f"KV payload is not a whole msgpack envelope ({type(err).__name__}: {err})") from err
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT_TAG:
        raise CorruptKVPayload("bytes are not a KV block payload (no format tag)")
    return envelope


def _check_version(envelope: dict) -> int:
    version = envelope.get("version")
    if type(version) is not int or version not in KNOWN_VERSIONS:
        raise IncompatibleKVPayload(f"KV payload format version: expected one of {KNOWN_VERSIONS}, got {version!r}")
    return version


def _check_geometry(raw: object, expected: KVGeometry) -> None:
    try:
        theirs = KVGeometry.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise IncompatibleKVPayload(f"KV payload geometry is unreadable: {err}") from err
    difference = expected.mismatch(theirs)
    if difference is not None:
        raise IncompatibleKVPayload(f"KV payload is for another model or layout: {difference}")


def _decode_block(geometry: KVGeometry, raw: object, index: int) -> KVBlockData:
    if not isinstance(raw, dict):
        raise CorruptKVPayload(f"block {index} is not a map")
    tokens, block_hash, parent = raw.get("tokens"), raw.get("hash"), raw.get("parent")
    if not isinstance(tokens, list) or not 0 < len(tokens) <= geometry.block_size:
        raise CorruptKVPayload(f"block {index} token count: expected 1..{geometry.block_size}, got {_length(tokens)}")
    if not all(type(t) is int and t >= 0 for t in tokens):
        raise CorruptKVPayload(f"block {index} token ids are not all non-negative integers")
    if not isinstance(block_hash, bytes) or not (parent is None or isinstance(parent, bytes)):
        raise CorruptKVPayload(f"block {index} hash or parent hash is not bytes")
    return KVBlockData(
        block_hash=block_hash,
        parent_hash=parent,
        token_ids=tuple(tokens),
        keys=_array_view(geometry, raw.get("k"), index, "keys"),
        values=_array_view(geometry, raw.get("v"), index, "values"),
    )


def _array_view(geometry: KVGeometry, data: object, index: int, part: str) -> np.ndarray:
    expected = block_array_bytes(geometry, part)
    if not isinstance(data, bytes) or len(data) != expected:
        name = "K" if part == "keys" else "V"
        raise CorruptKVPayload(f"block {index} {name} bytes: expected {expected}, got {_length(data)}")
    view = np.frombuffer(data, dtype=wire_dtype(geometry)).reshape(block_array_shape(geometry, part))
    return view.view(geometry.numpy_storage_dtype)


def _length(value: object) -> object:
    return len(value) if hasattr(value, "__len__") else type(value).__name__
