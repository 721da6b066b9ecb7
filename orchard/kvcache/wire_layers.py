"""Wire format version 3: a chunk of full blocks laid out layer by layer, for links.

Versions 1 and 2 (`orchard.kvcache.wire`) lay a payload out block by block, each block's K
and V for every layer in turn: a sender writes one slice of the pool per block and layer,
and a receiver one per layer only after matching every block record. The pool keeps one
array per layer, so a chunk of blocks with consecutive ids is one slice per layer there.
Version 3 puts those slices on the wire as they lie: for each layer, all of the chunk's
blocks' K then their V, so export hands the socket two slices per layer and import copies
two per layer, whatever the number of blocks.

    {"format": tag, "version": 3, "geometry": {...},
     "blocks": {"hashes": bin[n*16], "parents": bin[n*16], "tokens": bin[n*block_size*4, <u4],
                "layers": [K_0, V_0, K_1, V_1, ...]},   # K_l: bin[n * key bytes of a block's layer]
     "checksum": bin[16]}

Five fields, as version 1, so a reader that knows only versions 1 and 2 stops at the
version check with its named error (`IncompatibleKVPayload`) rather than mis-reading it.
Geometry (the model's fingerprint) and the xxh3_128 checksum are checked as for version
2. Full blocks of a prefix run only, and no recurrent state: a hybrid model's run, or a
chunk that holds a partial block, travels as version 2. A link asks for this layout
(`orchard.node.serving.kv_link`) and a source that cannot give it answers in version 2.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.hashing import HASH_SIZE
from orchard.kvcache.wire import (
    CHECKSUM_SIZE,
    FORMAT_TAG,
    BlockRun,
    KVPayload,
    _check_geometry,
    wire_dtype,
)
from orchard.kvcache.wire_batch import array_header, bin_header
from orchard.kvcache.wire_stream import Piece, _Reader, read_checked, read_envelope_body, read_envelope_head

LAYER_FORMAT_VERSION = 3
_TOKEN = np.dtype("<u4")


@dataclass(frozen=True)
class LayerChunk:
    """A chunk to send layer-major: `hashes`/`parents` `[n, 16]` uint8, `tokens` `[n, block_size]`,
    `keys[l]`/`values[l]` layer l's bytes for all n blocks (a slice of the pool's layer where it can be)."""

    hashes: np.ndarray
    parents: np.ndarray
    tokens: np.ndarray
    keys: Sequence[Piece]
    values: Sequence[Piece]


def layer_pieces(geometry: KVGeometry, chunk: LayerChunk) -> list[Piece]:
    """A version 3 payload but for its checksum, as pieces (`orchard.kvcache.wire_transit.OutgoingPayload`
    checksums them as they are sent); the KV pieces are the chunk's own buffers."""
    n = len(chunk.hashes)
    _check_chunk(geometry, chunk, n)
    layout = chunk_layout(geometry, n)
    tokens = np.ascontiguousarray(chunk.tokens, dtype=_TOKEN)
    before_hashes, before_parents, before_tokens, before_layers = layout.heads
    pieces: list[Piece] = [before_hashes, _bytes_of(chunk.hashes), before_parents, _bytes_of(chunk.parents),
                           before_tokens, _bytes_of(tokens), before_layers]
    for k, v in zip(chunk.keys, chunk.values, strict=True):
        pieces += [layout.key_header, memoryview(k).cast("B"), layout.value_header, memoryview(v).cast("B")]
    pieces.append(TRAILER)
    return pieces


#: What follows the last layer's V: the checksum's field name and its bytes' header (then the 16 bytes).
TRAILER = b"\xa8checksum" + bin_header(CHECKSUM_SIZE)


@dataclass(frozen=True)
class ChunkLayout:
    """Where the bytes of a version 3 payload of `n` full blocks lie. Every byte but the hashes, parents,
    token ids, KV and checksum is fixed by the geometry and `n`, and `n` by the payload's size, so a
    receiver that knows the size knows where each layer's K and V will land before they arrive, and can
    read them straight into place (`orchard.kvcache.wire_transit.IncomingPayload.place`)."""

    n: int
    heads: tuple[bytes, bytes, bytes, bytes]  # before the hashes, the parents, the token ids; the layers' array header
    key_header: bytes  # before each layer's K bytes (all n blocks')
    value_header: bytes
    key_bytes: int  # one layer's K, all n blocks
    value_bytes: int
    num_layers: int
    block_size: int

    @functools.cached_property
    def meta_size(self) -> int:
        """Bytes from the payload's start to its first layer's K header: the envelope, hashes, parents, token ids."""
        return sum(map(len, self.heads)) + self.n * (2 * HASH_SIZE + self.block_size * _TOKEN.itemsize)

    @functools.cached_property
    def size(self) -> int:
        """The whole payload's bytes, checksum included."""
        layer = len(self.key_header) + self.key_bytes + len(self.value_header) + self.value_bytes
        return self.meta_size + self.num_layers * layer + len(TRAILER) + CHECKSUM_SIZE

    def read_meta(self, meta: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(hashes, parents, tokens) from the first `meta_size` bytes of a payload, views into them; None
        where a fixed byte differs (another version, another model's geometry: read it as a whole payload).
        Nothing here is checked against the checksum yet."""
        if len(meta) != self.meta_size:
            return None
        columns, at = [], 0
        widths = (self.n * HASH_SIZE, self.n * HASH_SIZE, self.n * self.block_size * _TOKEN.itemsize, 0)
        for head, width in zip(self.heads, widths):
            if meta[at : at + len(head)] != head:
                return None
            at += len(head)
            columns.append(meta[at : at + width])
            at += width
        tokens = np.frombuffer(columns[2], dtype=_TOKEN).reshape(self.n, self.block_size)
        return _rows(columns[0], HASH_SIZE, "hashes"), _rows(columns[1], HASH_SIZE, "parents"), tokens.astype(np.uint32, copy=False)


@functools.lru_cache(maxsize=64)
def chunk_layout(geometry: KVGeometry, n: int) -> ChunkLayout:
    """The layout of `geometry`'s version 3 payloads of `n` blocks (the bytes `layer_pieces` writes)."""
    key_bytes, value_bytes = n * geometry.key_bytes_per_block_layer, n * geometry.value_bytes_per_block_layer
    token_bytes = n * geometry.block_size * _TOKEN.itemsize
    heads = (_envelope_head(geometry) + b"\xa6hashes" + bin_header(n * HASH_SIZE),
             b"\xa7parents" + bin_header(n * HASH_SIZE),
             b"\xa6tokens" + bin_header(token_bytes),
             b"\xa6layers" + array_header(2 * geometry.num_layers))
    return ChunkLayout(n, heads, bin_header(key_bytes), bin_header(value_bytes), key_bytes, value_bytes,
                       geometry.num_layers, geometry.block_size)


@functools.lru_cache(maxsize=64)
def layout_of_size(geometry: KVGeometry, size: int) -> ChunkLayout | None:
    """The layout of a version 3 payload of `size` bytes, or None where no number of blocks makes that size
    (asked once a chunk received: a pull's chunks share a size or two). A block adds the same bytes whatever
    `n`, but for a header or two a few bytes wider past 255 or 65,535 bytes, far fewer than a block's: so `n`
    is that quotient, or one either side of it."""
    one = chunk_layout(geometry, 1)
    per_block = chunk_layout(geometry, 2).size - one.size
    guess = 1 + (size - one.size) // per_block
    for n in (guess, guess - 1, guess + 1):
        if n >= 1 and chunk_layout(geometry, n).size == size:
            return chunk_layout(geometry, n)
    return None


def read_views(data: memoryview, digest: bytes, expected: KVGeometry, expected_state: StateGeometry | None = None) -> KVPayload:
    """A received payload of any version as views into `data`, checked as every payload is
    (`wire_stream.read_checked`: `digest` against the last 16 bytes first); version 3 is read here,
    the others by `orchard.kvcache.wire_stream`."""
    def read(reader: _Reader) -> KVPayload:
        fields, version = read_envelope_head(reader)
        if (fields, version) != (5, LAYER_FORMAT_VERSION):
            return read_envelope_body(reader, fields, version, expected, expected_state)
        if expected_state is not None:
            raise IncompatibleKVPayload("KV payload of version 3 has no recurrent state: a hybrid model cannot resume from it")
        reader.key("geometry")
        _check_geometry(reader.value(), expected)
        run = _read_run(reader, expected)
        reader.key("checksum")
        reader.bin(CHECKSUM_SIZE)
        return KVPayload(run)

    return read_checked(data, digest, read)


def _read_run(reader: _Reader, geometry: KVGeometry) -> BlockRun:
    reader.key("blocks")
    if reader.map_header() != 4:
        raise CorruptKVPayload("KV payload of version 3 has no block map")
    reader.key("hashes")
    hashes = _rows(reader.bin(), HASH_SIZE, "hashes")
    n = len(hashes)
    reader.key("parents")
    parents = _rows(reader.bin(n * HASH_SIZE), HASH_SIZE, "parents")
    reader.key("tokens")
    tokens = np.frombuffer(reader.bin(n * geometry.block_size * 4), dtype=_TOKEN).reshape(n, geometry.block_size)
    reader.key("layers")
    if reader.array_header() != 2 * geometry.num_layers or n == 0:
        raise CorruptKVPayload("KV payload of version 3 does not hold a K and a V for every layer")
    keys, values = _layer_columns(reader, geometry, n)
    return BlockRun(hashes, parents, tokens.astype(np.uint32, copy=False), keys, values)


def _layer_columns(reader: _Reader, geometry: KVGeometry, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's K and V as two `[n, num_layers, block_size, heads, its head dim]` views into the
    payload: the layers lie equally spaced, so one strided view each, no copy."""
    key_bytes, value_bytes = n * geometry.key_bytes_per_block_layer, n * geometry.value_bytes_per_block_layer
    start = reader.pos
    first_k, first_v = reader.bin(key_bytes), reader.bin(value_bytes)
    step = reader.pos - start  # one layer's K and V with their headers
    for _ in range(geometry.num_layers - 1):
        reader.bin(key_bytes)
        reader.bin(value_bytes)
    return _strided(geometry, first_k, step, n, "keys"), _strided(geometry, first_v, step, n, "values")


def _strided(geometry: KVGeometry, first: memoryview, step: int, n: int, part: str) -> np.ndarray:
    block_shape = geometry.value_block_shape if part == "values" else geometry.key_block_shape
    layer = np.frombuffer(first, dtype=wire_dtype(geometry)).reshape(n, *block_shape)
    layer = layer if layer.dtype == geometry.numpy_storage_dtype else layer.view(geometry.numpy_storage_dtype)
    strides = (layer.strides[0], step, *layer.strides[1:])
    return np.lib.stride_tricks.as_strided(layer, (n, geometry.num_layers, *block_shape), strides, writeable=False)


def _rows(data: memoryview, width: int, name: str) -> np.ndarray:
    if len(data) % width:
        raise CorruptKVPayload(f"KV payload {name} of {len(data)} bytes are not whole {width}-byte rows")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width)


def _envelope_head(geometry: KVGeometry) -> bytes:
    pack = msgpack.Packer(use_bin_type=True).pack
    return (b"\x85" + pack("format") + pack(FORMAT_TAG) + pack("version") + pack(LAYER_FORMAT_VERSION)
            + pack("geometry") + pack(geometry.to_dict()) + pack("blocks") + b"\x84")


def _check_chunk(geometry: KVGeometry, chunk: LayerChunk, n: int) -> None:
    if n == 0 or chunk.parents.shape != (n, HASH_SIZE) or chunk.hashes.shape != (n, HASH_SIZE):
        raise ValueError(f"a layer-major chunk needs one 16-byte hash and parent per block, got {n} blocks")
    if chunk.tokens.shape != (n, geometry.block_size):
        raise ValueError(f"a layer-major chunk holds full blocks of {geometry.block_size} tokens, got {chunk.tokens.shape}")
    if len(chunk.keys) != geometry.num_layers or len(chunk.values) != geometry.num_layers:
        raise ValueError(f"a layer-major chunk needs {geometry.num_layers} layers of K and V")
    sizes = {memoryview(k).nbytes for k in chunk.keys}, {memoryview(v).nbytes for v in chunk.values}
    if sizes != ({n * geometry.key_bytes_per_block_layer}, {n * geometry.value_bytes_per_block_layer}):
        raise ValueError(f"a layer of {n} blocks holds {n * geometry.key_bytes_per_block_layer} K bytes, got {sizes[0]}")


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")
