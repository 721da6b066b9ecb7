"""The block wire format (`kvcache.wire`) written as pieces and read as views, for links.

`encode_blocks` and `decode_blocks` make and read one bytes object, which costs two
copies of every KV byte (msgpack's buffer on the way out, msgpack's bin objects on the
way in). A socket does not need one object: `encode_pieces` lays the very same bytes
out as a list of small msgpack headers and buffers that point into the pool's arrays,
so a scatter-gather send reads the KV where it lies; `decode_views` reads a received
payload in place and hands back numpy views into it. Both are the format `kvcache.wire`
defines, field for field (tests pin that each reads the other's payloads); the one
liberty taken is msgpack's: token ids are written at one width, so equal blocks are
equally spaced.

The reader knows only the msgpack forms the writer emits (fixmap/map16, str8, ints,
nil, bin, arrays); anything else is refused as corrupt. The checksum is verified on the
raw bytes before any of that runs, so the reader only ever walks bytes a peer meant.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from kvcache.errors import CorruptKVPayload
from kvcache.geometry import KVGeometry
from kvcache.wire import (
    CHECKSUM_SIZE,
    FORMAT_TAG,
    FORMAT_VERSION,
    KVBlockData,
    _check_geometry,
    _check_version,
    block_array_shape,
    wire_dtype,
)

#: A piece of an encoded payload: anything the buffer protocol can send.
Piece = bytes | memoryview


@dataclass
class BlockPieces:
    """One block to send; `keys[l]` / `values[l]` are layer l's bytes (`bytes_per_block_layer` each)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: Sequence[int]
    keys: Sequence[Piece]
    values: Sequence[Piece]


def encode_pieces(geometry: KVGeometry, blocks: Sequence[BlockPieces]) -> list[Piece]:
    """The payload `encode_blocks` would make, as pieces whose KV parts are the given buffers."""
    pack = msgpack.Packer(use_bin_type=True).pack
    layer_bytes = geometry.bytes_per_block_layer
    kv_header = _bin_header(geometry.num_layers * layer_bytes)
    head = bytearray(_map_header(5))
    head += pack("format") + pack(FORMAT_TAG) + pack("version") + pack(FORMAT_VERSION)
    head += pack("geometry") + pack(geometry.to_dict()) + pack("blocks") + _array_header(len(blocks))
    pieces: list[Piece] = []
    for block in blocks:
        if not 0 < len(block.token_ids) <= geometry.block_size:
            raise ValueError(f"a block holds 1..{geometry.block_size} tokens, got {len(block.token_ids)}")
        parent = b"\xc0" if block.parent_hash is None else _bin_header(len(block.parent_hash)) + bytes(block.parent_hash)
        head += b"\x85\xa4hash" + _bin_header(len(block.block_hash)) + bytes(block.block_hash) + b"\xa6parent" + parent
        head += b"\xa6tokens" + _tokens(block.token_ids, pack) + b"\xa1k" + kv_header
        pieces.append(bytes(head))
        pieces.extend(_checked_layers(block.keys, geometry, layer_bytes))
        pieces.append(b"\xa1v" + kv_header)
        pieces.extend(_checked_layers(block.values, geometry, layer_bytes))
        head = bytearray()
    head += pack("checksum") + _bin_header(CHECKSUM_SIZE)
    pieces.append(bytes(head))
    digest = xxhash.xxh3_128()
    for piece in pieces:
        digest.update(piece)
    pieces.append(digest.digest())
    return pieces


def decode_views(payload, expected: KVGeometry) -> list[KVBlockData]:
    """Blocks of `payload` (any buffer) if made for `expected`; K/V are views into `payload`.

    The views are valid as long as `payload` is and change if it does: import them
    before the buffer is reused.
    """
    data = memoryview(payload).cast("B")
    if len(data) <= CHECKSUM_SIZE:
        raise CorruptKVPayload(f"KV payload of {len(data)} bytes is too short to hold anything")
    if xxhash.xxh3_128_digest(data[:-CHECKSUM_SIZE]) != bytes(data[-CHECKSUM_SIZE:]):
        raise CorruptKVPayload("KV payload checksum mismatch: the bytes were damaged on the way")
    reader = _Reader(data)
    try:
        blocks = _read_envelope(reader, expected)
    except (IndexError, struct.error, UnicodeDecodeError) as err:
        raise CorruptKVPayload(f"KV payload is not a whole envelope ({type(err).__name__}: {err})") from err
    if reader.pos != len(data):
        raise CorruptKVPayload(f"KV payload has {len(data) - reader.pos} bytes after its envelope")
    return blocks


# ---- writing ------------------------------------------------------------------------


def _checked_layers(layers: Sequence[Piece], geometry: KVGeometry, layer_bytes: int) -> list[Piece]:
    if len(layers) != geometry.num_layers:
        raise ValueError(f"a block needs {geometry.num_layers} layers, got {len(layers)}")
    out = [memoryview(layer).cast("B") for layer in layers]
    if {len(layer) for layer in out} != {layer_bytes}:
        raise ValueError(f"each layer of a block holds {layer_bytes} bytes, got {[len(x) for x in out]}")
    return out


@functools.lru_cache(maxsize=64)
def _token_struct(n: int) -> struct.Struct:
    return struct.Struct(">" + "BI" * n)


def _tokens(token_ids: Sequence[int], pack) -> bytes:
    """Token ids as msgpack uint32s, every one the same width (msgpack's packer picks the
    narrowest): blocks of one shape are then equally spaced in a payload, and a reader can
    take all their K (or V) as one strided array (`kvcache.pool.KVPool.write_block_arrays`)."""
    ids = [int(t) for t in token_ids]
    if not ids or min(ids) < 0 or max(ids) >= 1 << 32:
        return pack(ids)
    tagged = [0xCE] * (2 * len(ids))
    tagged[1::2] = ids
    return _array_header(len(ids)) + _token_struct(len(ids)).pack(*tagged)


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + bytes([n])
    return b"\xc5" + struct.pack(">H", n) if n < 1 << 16 else b"\xc6" + struct.pack(">I", n)


# ---- reading ------------------------------------------------------------------------


def _read_envelope(reader: _Reader, expected: KVGeometry) -> list[KVBlockData]:
    if reader.map_header() != 5 or reader.str() != "format" or reader.value() != FORMAT_TAG:
        raise CorruptKVPayload("bytes are not a KV block payload (no format tag)")
    reader.key("version")
    _check_version({"version": reader.value()})
    reader.key("geometry")
    _check_geometry(reader.value(), expected)
    reader.key("blocks")
    layout = _BlockLayout.of(expected)
    blocks = [_read_block(reader, layout, i) for i in range(reader.array_header())]
    reader.key("checksum")
    reader.bin(CHECKSUM_SIZE)
    return blocks


@dataclass(frozen=True)
class _BlockLayout:
    """What every block of one payload shares, worked out once per payload rather than per block."""

    block_size: int
    nbytes: int  # K (or V) bytes of one block, all layers
    k_header: bytes
    v_header: bytes
    wire: np.dtype
    storage: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, geometry: KVGeometry) -> _BlockLayout:
        nbytes = geometry.num_layers * geometry.bytes_per_block_layer
        return cls(geometry.block_size, nbytes, b"\xa1k" + _bin_header(nbytes), b"\xa1v" + _bin_header(nbytes),
                   wire_dtype(geometry), geometry.numpy_storage_dtype, block_array_shape(geometry))

    def view(self, data: memoryview) -> np.ndarray:
        view = np.frombuffer(data, dtype=self.wire).reshape(self.shape)
        return view if view.dtype == self.storage else view.view(self.storage)


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
    keys = layout.view(reader.take(layout.nbytes))
    reader.expect(layout.v_header, index)
    values = layout.view(reader.take(layout.nbytes))
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
