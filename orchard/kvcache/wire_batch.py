"""A payload's full blocks written and read all at once, as rows of one byte array.

A link's blocks are full, with 16-byte hashes and parents and token ids written at one
width (`orchard.kvcache.wire_stream`), so every block's record (its msgpack map: field names, hash,
parent, tokens, K, V) has one length and one layout, and a payload's blocks are a 2-D byte
array with one row per block. Writing fills the varying columns of a template header for
every block at once; reading compares every fixed byte of every row with the template at
once and takes the columns as arrays (`orchard.kvcache.wire.BlockRun`). Reading is a few numpy calls
a chunk; writing, those and one header view a block (a piece of the scatter-gather send).

The bytes are the ones the per-block writer emits and the per-block reader accepts (tests
pin both); a payload laid out any other way (a partial block, a nil parent, token ids in
msgpack's narrowest forms as `orchard.kvcache.wire.encode_blocks` packs them) is left to them.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import HASH_SIZE
from orchard.kvcache.wire import BlockRun, block_array_bytes, block_array_shape, wire_dtype

_UINT32 = 0xCE  # msgpack's tag of a uint32


@dataclass(frozen=True, eq=False)
class RecordLayout:
    """Where the fields of one full block's record lie, in bytes from the record's start."""

    header: np.ndarray  # the record up to K's bytes, zero where hash, parent and token ids go
    value_header: bytes  # between K's bytes and V's
    hash_at: int
    parent_at: int
    tokens_at: int  # the first token's uint32 tag; a token takes 5 bytes
    block_size: int
    key_bytes: int
    value_bytes: int
    fixed: np.ndarray  # indexes of the record's bytes every full block shares
    fixed_bytes: np.ndarray

    @property
    def key_at(self) -> int:
        return len(self.header)

    @property
    def value_at(self) -> int:
        return self.key_at + self.key_bytes + len(self.value_header)

    @property
    def size(self) -> int:
        return self.value_at + self.value_bytes


@functools.lru_cache(maxsize=16)
def record_layout(geometry: KVGeometry) -> RecordLayout:
    """The record layout of `geometry`'s full blocks (one per model: worked out once)."""
    bs = geometry.block_size
    key_bytes, value_bytes = block_array_bytes(geometry, "keys"), block_array_bytes(geometry, "values")
    hash_field = b"\xc4" + bytes([HASH_SIZE]) + bytes(HASH_SIZE)
    head = b"\x85\xa4hash" + hash_field + b"\xa6parent" + hash_field + b"\xa6tokens" + array_header(bs)
    hash_at, parent_at, tokens_at = 8, 8 + HASH_SIZE + 9, len(head)
    header = head + (bytes([_UINT32]) + bytes(4)) * bs + b"\xa1k" + bin_header(key_bytes)
    value_header = b"\xa1v" + bin_header(value_bytes)
    varying = {*range(hash_at, hash_at + HASH_SIZE), *range(parent_at, parent_at + HASH_SIZE)}
    varying |= {tokens_at + 5 * i + j for i in range(bs) for j in range(1, 5)}
    fixed = [i for i in range(len(header)) if i not in varying]
    value_header_at = len(header) + key_bytes
    fixed += range(value_header_at, value_header_at + len(value_header))
    record = np.frombuffer(header + bytes(key_bytes) + value_header, dtype=np.uint8)
    fixed_index = np.asarray(fixed, dtype=np.intp)
    return RecordLayout(
        np.frombuffer(header, dtype=np.uint8), value_header, hash_at, parent_at, tokens_at, bs, key_bytes, value_bytes, fixed_index, record[fixed_index]
    )


def write_headers(
    geometry: KVGeometry, hashes: Sequence[bytes], parents: Sequence[bytes | None], token_ids: Sequence[Sequence[int]]
) -> list[memoryview] | None:
    """Every block's record header (the bytes before its K), built at once; None where a block is
    not full, has a hash or parent that is not 16 bytes, or a token id past uint32: those take
    the per-block writer."""
    layout, n = record_layout(geometry), len(hashes)
    if not n or any(p is None for p in parents) or not _all_sized(hashes, parents):
        return None
    tokens = _token_array(token_ids, layout.block_size)
    if tokens is None:
        return None
    rows = np.tile(layout.header, (n, 1))
    rows[:, layout.hash_at : layout.hash_at + HASH_SIZE] = np.frombuffer(b"".join(hashes), np.uint8).reshape(n, HASH_SIZE)
    rows[:, layout.parent_at : layout.parent_at + HASH_SIZE] = np.frombuffer(b"".join(parents), np.uint8).reshape(n, HASH_SIZE)
    token_cells = rows[:, layout.tokens_at : layout.tokens_at + 5 * layout.block_size].reshape(n, layout.block_size, 5)
    token_cells[:, :, 1:] = tokens.astype(">u4").view(np.uint8).reshape(n, layout.block_size, 4)
    flat, width = memoryview(rows.reshape(-1)), rows.shape[1]
    return [flat[i : i + width] for i in range(0, n * width, width)]


def read_run(geometry: KVGeometry, data: memoryview, at: int, count: int) -> BlockRun | None:
    """The `count` blocks whose records start at `data[at]`, if every one is a full block laid out
    as `write_headers` lays it out (every fixed byte compared); else None, for the per-block reader."""
    layout = record_layout(geometry)
    if count == 0 or at + count * layout.size > len(data):
        return None
    rows = np.frombuffer(data, dtype=np.uint8, count=count * layout.size, offset=at).reshape(count, layout.size)
    if not np.array_equal(rows[:, layout.fixed], np.broadcast_to(layout.fixed_bytes, (count, len(layout.fixed)))):
        return None
    cells = rows[:, layout.tokens_at : layout.tokens_at + 5 * layout.block_size].reshape(count, layout.block_size, 5)
    tokens = np.ascontiguousarray(cells[:, :, 1:]).view(">u4").reshape(count, layout.block_size).astype(np.uint32)
    keys = _kv_columns(geometry, rows, layout.key_at, layout.key_bytes, "keys")
    values = _kv_columns(geometry, rows, layout.value_at, layout.value_bytes, "values")
    return BlockRun(rows[:, layout.hash_at : layout.hash_at + HASH_SIZE], rows[:, layout.parent_at : layout.parent_at + HASH_SIZE], tokens, keys, values)


def _kv_columns(geometry: KVGeometry, rows: np.ndarray, at: int, nbytes: int, part: str) -> np.ndarray:
    """Every row's K (or V) bytes as one `[n, num_layers, ...]` view, in the pool's storage dtype."""
    view = rows[:, at : at + nbytes].view(wire_dtype(geometry)).reshape(len(rows), *block_array_shape(geometry, part))
    storage = geometry.numpy_storage_dtype
    return view if view.dtype == storage else view.view(storage)


def _token_array(token_ids: Sequence[Sequence[int]], block_size: int) -> np.ndarray | None:
    """The token ids as an `[n, block_size]` array, or None where a block is not full or an id is not a uint32."""
    try:
        tokens = np.array(token_ids, dtype=np.int64)
    except (ValueError, OverflowError, TypeError):  # ragged, or an id past int64
        return None
    if tokens.ndim != 2 or tokens.shape[1] != block_size or (tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32)):
        return None
    return tokens


def _all_sized(hashes: Sequence[bytes], parents: Sequence[bytes]) -> bool:
    return all(len(h) == HASH_SIZE for h in hashes) and all(len(p) == HASH_SIZE for p in parents)


def array_header(n: int) -> bytes:
    """msgpack's header of an array of `n` entries."""
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


def bin_header(n: int) -> bytes:
    """msgpack's header of `n` raw bytes."""
    if n < 1 << 8:
        return b"\xc4" + bytes([n])
    return b"\xc5" + struct.pack(">H", n) if n < 1 << 16 else b"\xc6" + struct.pack(">I", n)
