"""The block wire format (`orchard.kvcache.wire`) written as pieces and read as views, for links.

`encode_blocks` and `decode_blocks` make and read one bytes object, which costs two
copies of every KV byte (msgpack's buffer on the way out, msgpack's bin objects on the
way in). A socket does not need one object: `payload_pieces` lays the very same bytes
(all but the checksum, which `orchard.kvcache.wire_transit.OutgoingPayload` takes as they are sent)
out as a list of small msgpack headers and buffers that point into the pool's arrays,
so a scatter-gather send reads the KV where it lies; `decode_views` reads a received
payload in place and hands back numpy views into it (a hybrid model's recurrent state
after the last block too: `payload_pieces(..., state)`, `decode_payload_views`). Both are the format `orchard.kvcache.wire`
defines, field for field (tests pin that each reads the other's payloads); the one
liberty taken is msgpack's: token ids are written at one width, so equal blocks are
equally spaced, and a payload of full blocks is written and read all at once, as rows of one
byte array (`orchard.kvcache.wire_batch`; the reader hands back a `orchard.kvcache.wire.BlockRun`).

The reader knows only the msgpack forms the writer emits (fixmap/map16, str8, ints,
nil, bin, arrays); anything else is refused as corrupt. The checksum is verified on the
raw bytes before any of that runs, so the reader only ever walks bytes a peer meant.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from orchard.kvcache.errors import CorruptKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.wire import (
    CHECKSUM_SIZE,
    FORMAT_TAG,
    FORMAT_VERSION,
    STATE_FORMAT_VERSION,
    KVBlockData,
    KVPayload,
    StateSnapshotData,
    _check_geometry,
    _check_version,
    _checksum,
    block_array_bytes,
    block_array_shape,
    check_state_geometry,
    check_state_presence,
    state_array_view,
    state_map,
    wire_dtype,
)
from orchard.kvcache.wire_batch import array_header, bin_header, read_run, record_layout, write_headers

#: A piece of an encoded payload: anything the buffer protocol can send.
Piece = bytes | memoryview


@dataclass
class BlockPieces:
    """One block to send; `keys[l]` / `values[l]` are layer l's bytes (`key_bytes_per_block_layer` /
    `value_bytes_per_block_layer` each)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: Sequence[int]
    keys: Sequence[Piece]
    values: Sequence[Piece]


def payload_pieces(geometry: KVGeometry, blocks: Sequence[BlockPieces],
                   state: StateSnapshotData | None = None) -> list[Piece]:
    """The payload `encode_blocks` would make but for its last 16 bytes, the checksum, as pieces whose KV
    (and state) parts are the given buffers; every piece is `bytes` or a memoryview of bytes, so its `len`
    is its size. The sender checksums the pieces as it sends them (`orchard.kvcache.wire_transit.OutgoingPayload`)."""
    pack = msgpack.Packer(use_bin_type=True).pack
    key_bytes, value_bytes = geometry.key_bytes_per_block_layer, geometry.value_bytes_per_block_layer
    version = FORMAT_VERSION if state is None else STATE_FORMAT_VERSION
    head = bytearray(_map_header(5 if state is None else 6))
    head += pack("format") + pack(FORMAT_TAG) + pack("version") + pack(version)
    head += pack("geometry") + pack(geometry.to_dict()) + pack("blocks") + array_header(len(blocks))
    pieces: list[Piece] = [bytes(head)]
    keys = _layer_pieces([block.keys for block in blocks], geometry, key_bytes)
    values = _layer_pieces([block.values for block in blocks], geometry, value_bytes)
    value_header = b"\xa1v" + bin_header(geometry.num_layers * value_bytes)
    layers = geometry.num_layers
    for i, header in enumerate(_block_headers(geometry, blocks, pack)):
        pieces.append(header)
        pieces += keys[i * layers : (i + 1) * layers]
        pieces.append(value_header)
        pieces += values[i * layers : (i + 1) * layers]
    head = bytearray()
    if state is not None:
        head = _state_pieces(state_map(state, blocks), head, pieces, pack)
    head += pack("checksum") + bin_header(CHECKSUM_SIZE)
    pieces.append(bytes(head))
    return pieces


def decode_views(payload, expected: KVGeometry) -> Sequence[KVBlockData]:
    """Blocks of `payload` (any buffer) if made for `expected`; K/V are views into `payload`.

    The views are valid as long as `payload` is and change if it does: import them
    before the buffer is reused.
    """
    return decode_payload_views(payload, expected).blocks


def decode_payload_views(payload, expected: KVGeometry, expected_state: StateGeometry | None = None) -> KVPayload:
    """`decode_views` for any model: also the recurrent state of a hybrid model's payload, read in
    place (`expected_state` is its state pool's geometry; None for a model without state)."""
    data = memoryview(payload).cast("B")
    return read_payload_views(data, _checksum(data), expected, expected_state)


def read_payload_views(data: memoryview, digest: bytes, expected: KVGeometry,
                       expected_state: StateGeometry | None = None) -> KVPayload:
    """`decode_payload_views` of `data` (bytes, one byte an item) whose xxh3_128 over every byte
    before its last 16 was taken as the bytes arrived (`orchard.kvcache.wire_transit.IncomingPayload`):
    `digest` is compared with those 16 bytes before anything else is read."""
    return read_checked(data, digest, lambda reader: read_envelope_body(reader, *read_envelope_head(reader),
                                                                         expected, expected_state))


def read_checked(data: memoryview, digest: bytes, read_envelope: Callable[[_Reader], KVPayload]) -> KVPayload:
    """`read_envelope` over `data` once `digest` matches its last 16 bytes, and only if it reads every
    byte: any reader of a payload (this format's, `orchard.kvcache.wire_layers`') goes through here."""
    if len(data) <= CHECKSUM_SIZE:
        raise CorruptKVPayload(f"KV payload of {len(data)} bytes is too short to hold anything")
    if digest != bytes(data[-CHECKSUM_SIZE:]):
        raise CorruptKVPayload("KV payload checksum mismatch: the bytes were damaged on the way")
    reader = _Reader(data)
    try:
        decoded = read_envelope(reader)
    except (IndexError, struct.error, UnicodeDecodeError) as err:
        raise CorruptKVPayload(f"KV payload is not a whole envelope ({type(err).__name__}: {err})") from err
    if reader.pos != len(data):
        raise CorruptKVPayload(f"KV payload has {len(data) - reader.pos} bytes after its envelope")
    return decoded


# ---- writing ------------------------------------------------------------------------


def _layer_pieces(per_block: Sequence[Sequence[Piece]], geometry: KVGeometry, layer_bytes: int) -> list[Piece]:
    """Every block's layers, in order, as byte views, each checked to hold `layer_bytes`."""
    if any(len(layers) != geometry.num_layers for layers in per_block):
        got = next(len(layers) for layers in per_block if len(layers) != geometry.num_layers)
        raise ValueError(f"a block needs {geometry.num_layers} layers, got {got}")
    out = [memoryview(layer).cast("B") for layers in per_block for layer in layers]
    if out and set(map(len, out)) != {layer_bytes}:
        raise ValueError(f"each layer of a block holds {layer_bytes} bytes, got {sorted(set(map(len, out)))}")
    return out


def _block_headers(geometry: KVGeometry, blocks: Sequence[BlockPieces], pack) -> list[Piece]:
    """Each block's record up to its K bytes: all at once where every block is full
    (`orchard.kvcache.wire_batch`), else block by block."""
    at_once = write_headers(geometry, [b.block_hash for b in blocks], [b.parent_hash for b in blocks],
                            [b.token_ids for b in blocks])
    return at_once if at_once is not None else [_block_header(geometry, block, pack) for block in blocks]


def _block_header(geometry: KVGeometry, block: BlockPieces, pack) -> bytes:
    if not 0 < len(block.token_ids) <= geometry.block_size:
        raise ValueError(f"a block holds 1..{geometry.block_size} tokens, got {len(block.token_ids)}")
    parent = b"\xc0" if block.parent_hash is None else bin_header(len(block.parent_hash)) + bytes(block.parent_hash)
    head = b"\x85\xa4hash" + bin_header(len(block.block_hash)) + bytes(block.block_hash) + b"\xa6parent" + parent
    k_header = bin_header(geometry.num_layers * geometry.key_bytes_per_block_layer)
    return head + b"\xa6tokens" + _tokens(block.token_ids, pack) + b"\xa1k" + k_header


@functools.lru_cache(maxsize=64)
def _token_struct(n: int) -> struct.Struct:
    return struct.Struct(">" + "BI" * n)


def _tokens(token_ids: Sequence[int], pack) -> bytes:
    """Token ids as msgpack uint32s, every one the same width (msgpack's packer picks the
    narrowest): blocks of one shape are then equally spaced in a payload, and a reader can
    take all their K (or V) as one strided array (`orchard.kvcache.pool.KVPool.write_block_arrays`)."""
    ids = [int(t) for t in token_ids]
    if not ids or min(ids) < 0 or max(ids) >= 1 << 32:
        return pack(ids)
    tagged = [0xCE] * (2 * len(ids))
    tagged[1::2] = ids
    return array_header(len(ids)) + _token_struct(len(ids)).pack(*tagged)


def _state_pieces(entry: dict, head: bytearray, pieces: list[Piece], pack) -> bytearray:
    """The `state` entry laid out as msgpack packs it, its arrays as pieces; returns the open header."""
    head += pack("state") + _map_header(3) + pack("geometry") + pack(entry["geometry"])
    head += pack("hash") + pack(entry["hash"]) + pack("arrays") + array_header(len(entry["arrays"]))
    for layer in entry["arrays"]:
        head += array_header(len(layer))
        for array in layer:
            pieces.append(bytes(head + bin_header(len(array))))
            pieces.append(array)
            head = bytearray()
    return head


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


# ---- reading ------------------------------------------------------------------------


def read_envelope_head(reader: _Reader) -> tuple[int, object]:
    """The envelope's field count and its version as written, the reader left after the version."""
    fields = reader.map_header()
    if fields not in (5, 6) or reader.str() != "format" or reader.value() != FORMAT_TAG:
        raise CorruptKVPayload("bytes are not a KV block payload (no format tag)")
    reader.key("version")
    return fields, reader.value()


def read_envelope_body(reader: _Reader, fields: int, version: object, expected: KVGeometry,
                       expected_state: StateGeometry | None) -> KVPayload:
    """The rest of a version 1 or 2 envelope (any other version refused by its named error)."""
    version = _check_version({"version": version})
    if fields != (5 if version == FORMAT_VERSION else 6):
        raise CorruptKVPayload(f"KV payload of version {version} has {fields} fields")
    reader.key("geometry")
    _check_geometry(reader.value(), expected)
    reader.key("blocks")
    layout = _BlockLayout.of(expected)
    num_blocks = reader.array_header()
    check_state_presence(version, num_blocks, expected_state)
    blocks = _read_blocks(reader, expected, layout, num_blocks)
    state = None if version == FORMAT_VERSION else _read_state(reader, expected_state)
    reader.key("checksum")
    reader.bin(CHECKSUM_SIZE)
    return KVPayload(blocks, state)


def _read_state(reader: _Reader, expected: StateGeometry) -> StateSnapshotData:
    """The `state` entry, its arrays as views into the payload."""
    reader.key("state")
    if reader.map_header() != 3:
        raise CorruptKVPayload("KV payload state map is not laid out as the wire format lays it out")
    reader.key("geometry")
    geometry = check_state_geometry(reader.value(limit=1 << 16), expected)
    reader.key("hash")
    block_hash = bytes(reader.bin())
    reader.key("arrays")
    if reader.array_header() != len(geometry.layers):
        raise CorruptKVPayload("KV payload state arrays are not laid out as its geometry says")
    arrays = []
    for index, specs in enumerate(geometry.layers):
        if reader.array_header() != len(specs):
            raise CorruptKVPayload("KV payload state arrays are not laid out as its geometry says")
        arrays.append([state_array_view(spec, reader.bin(spec.nbytes), index, kind) for kind, spec in enumerate(specs)])
    return StateSnapshotData(block_hash, geometry, arrays)


@dataclass(frozen=True)
class _BlockLayout:
    """What every block of one payload shares, worked out once per payload rather than per block."""

    block_size: int
    key_bytes: int  # K bytes of one block, all layers
    value_bytes: int  # V bytes of one block, all layers
    k_header: bytes
    v_header: bytes
    wire: np.dtype
    storage: np.dtype
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]

    @classmethod
    def of(cls, geometry: KVGeometry) -> _BlockLayout:
        key_bytes, value_bytes = block_array_bytes(geometry, "keys"), block_array_bytes(geometry, "values")
        return cls(geometry.block_size, key_bytes, value_bytes, b"\xa1k" + bin_header(key_bytes),
                   b"\xa1v" + bin_header(value_bytes), wire_dtype(geometry), geometry.numpy_storage_dtype,
                   block_array_shape(geometry, "keys"), block_array_shape(geometry, "values"))

    def view(self, data: memoryview, shape: tuple[int, ...]) -> np.ndarray:
        view = np.frombuffer(data, dtype=self.wire).reshape(shape)
        return view if view.dtype == self.storage else view.view(self.storage)


def _read_blocks(reader: _Reader, geometry: KVGeometry, layout: _BlockLayout, count: int) -> Sequence[KVBlockData]:
    """All `count` blocks: at once where every one is full and laid out as the writer lays full
    blocks out (`orchard.kvcache.wire_batch`), else block by block."""
    run = read_run(geometry, reader.data, reader.pos, count)
    if run is None:
        return [_read_block(reader, layout, i) for i in range(count)]
    reader.pos += count * record_layout(geometry).size
    return run


def _read_block(reader: _Reader, layout: _BlockLayout, index: int) -> KVBlockData:
    """One block; its field names and K/V headers are compared as whole byte runs (few calls per block)."""
    reader.expect(b"\x85\xa4hash", index)
    block_hash = reader.bin()
    reader.expect(b"\xa6parent", index)
    parent = reader.nil_or_bin()
    reader.expect(b"\xa6tokens", index)
    tokens = reader.value(limit=3 + 9 * layout.block_size)
    if not isinstance(tokens, list) or not 0 < len(tokens) <= layout.block_size:
        raise CorruptKVPayload(f"block {index} token count: expected 1..{layout.block_size}")
    if not all(type(t) is int and t >= 0 for t in tokens):
        raise CorruptKVPayload(f"block {index} token ids are not all non-negative integers")
    reader.expect(layout.k_header, index)
    keys = layout.view(reader.take(layout.key_bytes), layout.key_shape)
    reader.expect(layout.v_header, index)
    values = layout.view(reader.take(layout.value_bytes), layout.value_shape)
    return KVBlockData(bytes(block_hash), None if parent is None else bytes(parent), tuple(tokens), keys, values)


class _Reader:
    """Walks the msgpack forms the writer emits; small values are unpacked by msgpack itself."""

    def __init__(self, data: memoryview):
        self.data = data
        self.size = len(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        start = self.pos
        self.pos = start + n
        if self.pos > self.size:
            raise CorruptKVPayload("KV payload ends inside its envelope")
        return self.data[start : self.pos]

    def _byte(self) -> int:
        return self.take(1)[0]

    def map_header(self) -> int:
        tag = self._byte()
        if 0x80 <= tag <= 0x8F:
            return tag & 0x0F
        if tag == 0xDE:
            return struct.unpack(">H", self.take(2))[0]
        raise CorruptKVPayload(f"expected a map at byte {self.pos - 1}")

    def array_header(self) -> int:
        tag = self._byte()
        if 0x90 <= tag <= 0x9F:
            return tag & 0x0F
        if tag in (0xDC, 0xDD):
            return struct.unpack(">H" if tag == 0xDC else ">I", self.take(2 if tag == 0xDC else 4))[0]
        raise CorruptKVPayload(f"expected an array at byte {self.pos - 1}")

    def bin(self, size: int | None = None) -> memoryview:
        tag = self._byte()
        widths = {0xC4: (1, ">B"), 0xC5: (2, ">H"), 0xC6: (4, ">I")}
        if tag not in widths:
            raise CorruptKVPayload(f"expected bytes at byte {self.pos - 1}")
        width, fmt = widths[tag]
        n = struct.unpack(fmt, self.take(width))[0]
        if size is not None and n != size:
            raise CorruptKVPayload(f"KV bytes: expected {size}, got {n}")
        return self.take(n)

    def nil_or_bin(self) -> memoryview | None:
        if self.data[self.pos] == 0xC0:
            self.pos += 1
            return None
        return self.bin()

    def str(self) -> str:
        tag = self._byte()
        if 0xA0 <= tag <= 0xBF:
            return str(self.take(tag & 0x1F), "utf-8")
        if tag == 0xD9:
            return str(self.take(self._byte()), "utf-8")
        raise CorruptKVPayload(f"expected a field name at byte {self.pos - 1}")

    def expect(self, run: bytes, index: int) -> None:
        if self.take(len(run)) != run:
            raise CorruptKVPayload(f"block {index} is not laid out as the wire format lays blocks out")

    def key(self, name: str) -> None:
        if self.str() != name:
            raise CorruptKVPayload(f"expected field {name!r} before byte {self.pos}")

    def value(self, limit: int = 4096):
        """One small value (str, int, nil, a token list, the geometry map) of at most `limit` bytes."""
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, read_size=limit, max_buffer_size=limit)
        unpacker.feed(self.data[self.pos : min(self.size, self.pos + limit)])
        try:
            value = unpacker.unpack()
        except (msgpack.OutOfData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as err:
            raise CorruptKVPayload(f"unreadable value at byte {self.pos}: {err}") from err
        self.pos += unpacker.tell()
        return value
