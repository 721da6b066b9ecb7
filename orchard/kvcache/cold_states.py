"""Recurrent-state snapshots evicted from memory with their blocks, in a memory-mapped file.

A hybrid model's cached KV blocks are worth keeping on disk only with the state snapshot
that lets a prompt resume after them (kvcache.state_snapshots): when a block that has one
spills to the cold tier, its snapshot spills here, and a later prefix hit on that block
restores both. This file sits beside the KV blocks' (`cold_file_path`, its own suffix) and is
laid out the same way, a header then fixed slots, one snapshot each::

    [header region, HEADER_REGION bytes]  magic, version, msgpack {state geometry, slots}, xxh3_64
    [slot 0][slot 1]...                   each: record (stamp, checksum, magic, key), then the arrays

A slot's checksum covers its key and every byte of its arrays and is verified on each read,
so a torn or damaged slot is dropped, never restored; a file made for another state geometry
is wiped. LRU by the stamp, which a restart reads back. One owner thread.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import OrderedDict
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from orchard.kvcache.cold_tier import HEADER_REGION, cold_file_path
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.private_files import open_locked, private_folder
from orchard.kvcache.wire import state_array_bytes, state_array_view

FILE_MAGIC = b"ORCHSTCT"
FILE_VERSION = 1
FILE_SUFFIX = ".statecold"
SLOT_MAGIC = b"STSL"
_PREFIX = struct.Struct("<8sII")  # file magic, version, header body length
_RECORD = struct.Struct("<QQ4sB32s")  # stamp, checksum of key + arrays, magic, key length, key
_MAGIC_AT = 16
_MAX_KEY_BYTES = 32
_SLOT_ALIGN = 4096


def cold_states_path(directory: str | os.PathLike, geometry: KVGeometry) -> Path:
    """The snapshots' file: the KV blocks' cold file with its own suffix."""
    return cold_file_path(directory, geometry).with_suffix(FILE_SUFFIX)


class ColdStates:
    """An LRU of state snapshots by block hash in fixed mmap slots, at most `slot_count` of them."""

    def __init__(self, path: Path, geometry: StateGeometry, slot_count: int):
        if slot_count < 1:
            raise ValueError("a cold state store needs at least one slot")
        self.path = path
        self.geometry = geometry
        self.slot_count = slot_count
        self.slot_bytes = -(-(_RECORD.size + geometry.nbytes) // _SLOT_ALIGN) * _SLOT_ALIGN
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free: list[int] = []
        self._next_stamp = 1
        private_folder(path.parent)
        self._fd = open_locked(path, "ColdStates")
        reusable = self._header_matches()
        if not reusable:
            self._format_file()
        self._mm = mmap.mmap(self._fd, HEADER_REGION + slot_count * self.slot_bytes)
        self._rebuild_index() if reusable else self._free.extend(range(slot_count - 1, -1, -1))

    # ---- public API -------------------------------------------------------------------

    def put(self, key: bytes, arrays: list[list[np.ndarray]]) -> list[bytes]:
        """Store a snapshot (`StatePool.host_copy`'s form) under `key`; returns the keys dropped to make room."""
        if not 0 < len(key) <= _MAX_KEY_BYTES:
            raise ValueError(f"a cold state key is 1 to {_MAX_KEY_BYTES} bytes, got {len(key)}")
        data = self._data_bytes(arrays)
        dropped: list[bytes] = []
        slot = self._index.pop(key, None)
        if slot is None:
            slot = self._free.pop() if self._free else self._drop_oldest(dropped)
        start = self._offset(slot)
        self._mm[start + _MAGIC_AT : start + _MAGIC_AT + len(SLOT_MAGIC)] = bytes(len(SLOT_MAGIC))  # torn until done
        self._mm[start + _RECORD.size : start + _RECORD.size + len(data)] = data
        record = _RECORD.pack(self._take_stamp(), _checksum(key, data), SLOT_MAGIC, len(key), key)
        self._mm[start : start + _RECORD.size] = record
        self._index[key] = slot
        return dropped

    def get(self, key: bytes) -> list[list[np.ndarray]] | None:
        """The snapshot stored under `key`, or None (absent, or damaged: then it is dropped)."""
        slot = self._index.get(key)
        if slot is None:
            return None
        start = self._offset(slot) + _RECORD.size
        data = bytes(self._mm[start : start + self.geometry.nbytes])
        if _checksum(key, data) != _RECORD.unpack_from(self._mm, self._offset(slot))[1]:
            self.discard(key)
            return None
        self._index.move_to_end(key)
        self._mm[self._offset(slot) : self._offset(slot) + 8] = struct.pack("<Q", self._take_stamp())
        return self._arrays(data)

    def discard(self, key: bytes) -> bool:
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        start = self._offset(slot) + _MAGIC_AT
        self._mm[start : start + len(SLOT_MAGIC)] = bytes(len(SLOT_MAGIC))
        self._free.append(slot)
        return True

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        return list(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        if self._fd is None:
            return
        self._mm.flush()
        self._mm.close()
        os.close(self._fd)  # also drops the lock
        self._fd = None

    # ---- slots and the file -------------------------------------------------------------

    def _offset(self, slot: int) -> int:
        return HEADER_REGION + slot * self.slot_bytes

    def _data_bytes(self, arrays: list[list[np.ndarray]]) -> bytes:
        layers = self.geometry.layers
        if len(arrays) != len(layers) or any(len(a) != len(specs) for a, specs in zip(arrays, layers)):
            raise ValueError("snapshot arrays do not match the state geometry's layers")
        return b"".join(state_array_bytes(spec, array, index, kind)
                        for index, (specs, layer) in enumerate(zip(layers, arrays))
                        for kind, (spec, array) in enumerate(zip(specs, layer)))

    def _arrays(self, data: bytes) -> list[list[np.ndarray]]:
        out, at, view = [], 0, memoryview(data)
        for index, specs in enumerate(self.geometry.layers):
            arrays = []
            for kind, spec in enumerate(specs):
                arrays.append(state_array_view(spec, view[at : at + spec.nbytes], index, kind))
                at += spec.nbytes
            out.append(arrays)
        return out

    def _drop_oldest(self, dropped: list[bytes]) -> int:
        key, slot = self._index.popitem(last=False)
        dropped.append(key)
        return slot

    def _take_stamp(self) -> int:
        stamp, self._next_stamp = self._next_stamp, self._next_stamp + 1
        return stamp

    def _header_body(self) -> bytes:
        return msgpack.packb({"geometry": self.geometry.to_list(), "slots": self.slot_count, "slot_bytes": self.slot_bytes})

    def _header_matches(self) -> bool:
        """True only for a file this store wrote, for this exact state geometry and slot count."""
        if os.fstat(self._fd).st_size != HEADER_REGION + self.slot_count * self.slot_bytes:
            return False
        head = os.pread(self._fd, HEADER_REGION, 0)
        magic, version, length = _PREFIX.unpack_from(head)
        body = head[_PREFIX.size : _PREFIX.size + length]
        stored_sum = head[_PREFIX.size + length : _PREFIX.size + length + 8]
        return (magic, version) == (FILE_MAGIC, FILE_VERSION) and body == self._header_body() and \
            stored_sum == xxhash.xxh3_64_digest(body)

    def _format_file(self) -> None:
        """An empty store: the file cut to nothing, then sized (zero slots are empty) and headed."""
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, HEADER_REGION + self.slot_count * self.slot_bytes)
        body = self._header_body()
        os.pwrite(self._fd, _PREFIX.pack(FILE_MAGIC, FILE_VERSION, len(body)) + body + xxhash.xxh3_64_digest(body), 0)

    def _rebuild_index(self) -> None:
        """The index of a reopened file from its slots' records, oldest stamp first; arrays are
        checked when read."""
        found = []
        for slot in range(self.slot_count):
            stamp, _, magic, key_len, key = _RECORD.unpack_from(self._mm, self._offset(slot))
            if magic == SLOT_MAGIC and 0 < key_len <= len(key):
                found.append((stamp, key[:key_len], slot))
            else:
                self._free.append(slot)
        for stamp, key, slot in sorted(found):
            self._index[key] = slot
            self._next_stamp = max(self._next_stamp, stamp + 1)


def _checksum(key: bytes, data: bytes) -> int:
    digest = xxhash.xxh3_64(key)
    digest.update(data)
    return digest.intdigest()
