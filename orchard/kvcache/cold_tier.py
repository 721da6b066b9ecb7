"""The cold tier: KV blocks evicted from the pool, kept in a memory-mapped file on disk.

One file per model, named from its fingerprint, laid out as a header then fixed-size
slots. Fixed slots make a block's place pure arithmetic (no allocator, no compaction)
and let `madvise` name exactly the pages one block lives in.

File layout::

    [header region, HEADER_REGION bytes]  magic, version, msgpack {geometry, slot layout}, xxh3_64
    [slot 0][slot 1]...                   each: metadata record, then K (all layers), then V (all layers)

A slot's metadata record carries the block's key, parent hash and token ids, a stamp for
LRU order, and two checksums (record, KV bytes), so a restarted node rebuilds its index
from the file and a torn or damaged slot is never read as KV. A file whose header does
not match this model and geometry exactly is wiped and rebuilt, never read; one that
differs only in its number of slots is resized, keeping its most recent blocks. The file
is 0600 in a 0700 folder and never opened through a symlink.

The tier emits no events; the cache facade that calls it does. One owner thread.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgpack
import numpy as np
import xxhash

from orchard.kvcache.errors import ColdTierError
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.private_files import open_locked, private_folder
from orchard.kvcache.wire import KVBlockData, block_array_bytes, block_array_shape

log = logging.getLogger(__name__)

FILE_MAGIC = b"ORCHKVCT"
FILE_VERSION = 1
FILE_SUFFIX = ".kvcold"
#: Large enough for the header and a multiple of both 4 KiB and 16 KiB (Apple) pages.
HEADER_REGION = 16384
SLOT_MAGIC = b"KVSL"
MAX_KEY_BYTES = 32
SLOT_ALIGN = 64

_PREFIX = struct.Struct("<8sII")  # file magic, version, header body length
_RECORD = struct.Struct("<QQQ4sBBBxI32s32s")  # stamp, record sum, KV sum, magic, has_parent, key len, parent len, n tokens, key, parent
_STAMP_END = 8  # the stamp sits outside the record checksum so a cold hit can refresh it cheaply
_SUMMED_FROM = 16
_MAGIC_AT = 24


class SlotRecord(NamedTuple):
    """A slot's metadata record as stored; `tail` holds the padded token ids."""

    stamp: int
    record_sum: int
    kv_sum: int
    magic: bytes
    has_parent: int
    key_len: int
    parent_len: int
    n_tokens: int
    key_field: bytes
    parent_field: bytes
    tail: bytes

    @property
    def key(self) -> bytes:
        return self.key_field[: self.key_len]

    @property
    def parent(self) -> bytes | None:
        return self.parent_field[: self.parent_len] if self.has_parent else None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.tail, dtype="<u4", count=self.n_tokens).tolist())


@dataclass(frozen=True)
class ColdTierStats:
    slots_used: int
    slots_total: int
    bytes_used: int
    bytes_capacity: int
    hits: int
    misses: int
    spills: int
    drops: int
    discards: int
    corrupt: int


@dataclass(frozen=True)
class SlotLayout:
    """Where everything of one slot lives, derived from the geometry alone."""

    record_size: int
    key_bytes: int  # K of one block, all layers
    value_bytes: int  # V of one block, all layers
    stride: int
    slot_count: int

    @classmethod
    def for_geometry(cls, geometry: KVGeometry, capacity_bytes: int) -> SlotLayout:
        record_size = _round_up(_RECORD.size + 4 * geometry.block_size, SLOT_ALIGN)
        key_bytes, value_bytes = block_array_bytes(geometry, "keys"), block_array_bytes(geometry, "values")
        stride = _round_up(record_size + key_bytes + value_bytes, SLOT_ALIGN)
        slot_count = capacity_bytes // stride
        if slot_count < 1:
            raise ValueError(f"cold tier capacity {capacity_bytes} bytes is below one slot of {stride} bytes")
        return cls(record_size, key_bytes, value_bytes, stride, slot_count)

    @classmethod
    def from_dict(cls, d: dict) -> SlotLayout:
        """As `to_dict` writes it: one `kv_half` where K and V are of one size."""
        key_bytes = d["kv_half"] if "kv_half" in d else d["key_bytes"]
        value_bytes = d["kv_half"] if "kv_half" in d else d["value_bytes"]
        return cls(d["record_size"], key_bytes, value_bytes, d["stride"], d["slot_count"])

    @property
    def file_size(self) -> int:
        return HEADER_REGION + self.slot_count * self.stride

    def offset(self, slot: int) -> int:
        return HEADER_REGION + slot * self.stride

    def to_dict(self) -> dict:
        """The header's layout entry; K and V of one size keep the single `kv_half` of files
        written before they could differ, so those files still match."""
        if self.key_bytes == self.value_bytes:
            sizes = {"kv_half": self.key_bytes}
        else:
            sizes = {"key_bytes": self.key_bytes, "value_bytes": self.value_bytes}
        return {"record_size": self.record_size, **sizes, "stride": self.stride, "slot_count": self.slot_count}


def cold_file_path(directory: str | os.PathLike, geometry: KVGeometry) -> Path:
    """The model's cold-tier file: named from its fingerprint, so models never share one."""
    return Path(directory) / f"{xxhash.xxh3_64_hexdigest(geometry.model_fingerprint.encode())}{FILE_SUFFIX}"


class ColdTier:
    """An LRU of KV blocks in fixed mmap slots, bounded by `capacity_bytes`."""

    def __init__(self, directory: str | os.PathLike, geometry: KVGeometry, capacity_bytes: int):
        self.geometry = geometry
        self.layout = SlotLayout.for_geometry(geometry, capacity_bytes)
        self.path = cold_file_path(directory, geometry)
        private_folder(self.path.parent)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free: list[int] = []
        self._next_stamp = 1
        self._counts = dict(hits=0, misses=0, spills=0, drops=0, discards=0, corrupt=0)
        self._fd = self._open_locked()
        try:
            self._map_file()
        except BaseException:
            os.close(self._fd)  # also drops the lock
            self._fd = None
            raise

    # ---- public API -------------------------------------------------------------------

    def put(self, key: bytes, keys_np: np.ndarray, values_np: np.ndarray,
            token_ids: Sequence[int], parent_hash: bytes | None) -> list[bytes]:
        """Store one block under `key`; returns the keys dropped (least recent first) to make room."""
        self._check_block(key, keys_np, values_np, token_ids, parent_hash)
        dropped: list[bytes] = []
        slot = self._index.pop(key, None)
        if slot is None:
            slot = self._free.pop() if self._free else self._drop_oldest(dropped)
        self._write_slot(slot, key, keys_np, values_np, token_ids, parent_hash)
        self._index[key] = slot
        self._counts["spills"] += 1
        return dropped

    def get(self, key: bytes) -> KVBlockData | None:
        """A copy of the block under `key` (which becomes most recent), or None."""
        slot = self._index.get(key)
        if slot is None:
            self._counts["misses"] += 1
            return None
        block = self._read_slot(slot, key)
        if block is None:
            log.warning("cold tier slot %d for key %s failed its checksum; dropped", slot, key.hex())
            self._counts["corrupt"] += 1
            self._counts["misses"] += 1
            self._release(key)
            return None
        self._index.move_to_end(key)
        self._stamp(slot)
        self._counts["hits"] += 1
        return block

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Ask the OS to start reading these blocks' pages now, ahead of `get`."""
        advice = getattr(mmap, "MADV_WILLNEED", None)
        for key in keys:
            slot = self._index.get(key)
            if slot is not None and advice is not None:
                start = self.layout.offset(slot)
                self._advise(advice, start, start + self.layout.stride, outward=True)

    def discard(self, key: bytes) -> bool:
        """Forget `key` and free its slot; False when it was not held."""
        released = self._release(key)
        self._counts["discards"] += released
        return released

    def keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        return list(self._index)

    def entries(self) -> list[tuple[bytes, bytes | None, tuple[int, ...]]]:
        """(key, parent hash, token ids) of every held block, least recent first, without
        reading KV: what a restarted node announces as its disk-tier blocks."""
        out = []
        for key, slot in self._index.items():
            record = self._valid_record(slot)
            if record is not None and record.key == key:
                out.append((key, record.parent, record.token_ids))
        return out

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> ColdTierStats:
        used = len(self._index)
        return ColdTierStats(
            slots_used=used,
            slots_total=self.layout.slot_count,
            bytes_used=used * self.layout.stride,
            bytes_capacity=self.layout.slot_count * self.layout.stride,
            **self._counts,
        )

    def flush(self) -> None:
        """Write dirty pages to the file, so a restart finds them."""
        self._mm.flush()

    def close(self) -> None:
        if self._fd is None:
            return
        self._mm.flush()
        self._mm.close()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()

    def __enter__(self) -> ColdTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the file ---------------------------------------------------------------------

    def _map_file(self) -> None:
        old_layout = self._resizable_from()
        if old_layout is not None:
            self._resize(old_layout)
        reusable = old_layout is not None or self._header_matches()
        if not reusable:
            self._format_file()
        self._mm = mmap.mmap(self._fd, self.layout.file_size)
        if reusable:
            self._rebuild_index()
        else:
            self._free = list(range(self.layout.slot_count - 1, -1, -1))

    def _resizable_from(self) -> SlotLayout | None:
        """The layout of a file that holds this model's blocks in slots of this size, only fewer or more."""
        size = os.fstat(self._fd).st_size
        reason = self._header_mismatch(size) if size else None
        if reason is None or not reason.startswith("slot layout"):  # checked: magic, version, checksum, geometry
            return None
        stored = self._stored_header()
        try:
            old = SlotLayout.from_dict(stored["layout"])
        except (KeyError, TypeError):
            return None
        same_slots = dataclasses.replace(old, slot_count=self.layout.slot_count) == self.layout
        if not same_slots or self._geometry_difference(stored.get("geometry")) is not None or size != old.file_size:
            return None
        return old

    def _stored_header(self) -> dict:
        head = os.pread(self._fd, HEADER_REGION, 0)
        _, _, body_len = _PREFIX.unpack_from(head)
        stored = msgpack.unpackb(head[_PREFIX.size : _PREFIX.size + body_len])
        return stored if isinstance(stored, dict) else {}

    def _resize(self, old: SlotLayout) -> None:
        """Keep the most recent blocks that fit the new slot count: moved into the low slots,
        then the file is cut or extended (new slots are zero, i.e. empty) and re-headed."""
        new, self.layout = self.layout, old
        self._mm = mmap.mmap(self._fd, old.file_size)
        try:
            self._rebuild_index()
            kept = list(self._index.items())[-new.slot_count:]
            held_low = {slot for _, slot in kept if slot < new.slot_count}
            targets = iter(s for s in range(new.slot_count) if s not in held_low)
            for _, slot in kept:
                if slot >= new.slot_count:
                    start, target = old.offset(slot), old.offset(next(targets))
                    self._mm[target : target + old.stride] = self._mm[start : start + old.stride]
            self._mm.flush()
        finally:
            self._mm.close()
            self._index.clear()
        self.layout = new
        os.ftruncate(self._fd, new.file_size)
        self._write_header()
        log.info("cold tier %s: resized from %d to %d slots", self.path, old.slot_count, new.slot_count)

    def _open_locked(self) -> int:
        return open_locked(self.path, "ColdTier")

    def _header_body(self) -> bytes:
        return msgpack.packb({"geometry": self.geometry.to_dict(), "layout": self.layout.to_dict()})

    def _header_matches(self) -> bool:
        """True only for a file this tier wrote, for this exact model, geometry and layout."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return False
        reason = self._header_mismatch(size)
        if reason is not None:
            log.warning("ignoring cold tier file %s: %s; it will be replaced", self.path, reason)
        return reason is None

    def _header_mismatch(self, size: int) -> str | None:
        head = os.pread(self._fd, HEADER_REGION, 0)
        if len(head) < _PREFIX.size:
            return "too short for a header"
        magic, version, body_len = _PREFIX.unpack_from(head)
        if magic != FILE_MAGIC:
            return "not a cold tier file"
        if version != FILE_VERSION:
            return f"format version: expected {FILE_VERSION}, got {version}"
        end = _PREFIX.size + body_len
        if end + 8 > len(head) or xxhash.xxh3_64_digest(head[:end]) != head[end : end + 8]:
            return "header checksum mismatch"
        stored = msgpack.unpackb(head[_PREFIX.size : end])
        if not isinstance(stored, dict):
            return "header body is not a map"
        difference = self._geometry_difference(stored.get("geometry"))
        if difference is not None:
            return difference
        if stored.get("layout") != self.layout.to_dict():
            return f"slot layout: expected {self.layout.to_dict()}, got {stored.get('layout')}"
        if size != self.layout.file_size:
            return f"file size: expected {self.layout.file_size}, got {size}"
        return None

    def _geometry_difference(self, stored: object) -> str | None:
        try:
            return self.geometry.mismatch(KVGeometry.from_dict(stored))
        except (KeyError, TypeError, ValueError) as err:
            return f"unreadable geometry ({err})"

    def _format_file(self) -> None:
        """Wipe the file and lay out an empty tier: header, then zeroed (invalid) slots."""
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, self.layout.file_size)
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self._fd, 0, self.layout.file_size)
            except OSError as err:
                raise ColdTierError(f"cannot reserve {self.layout.file_size} bytes for {self.path}: {err}") from err
        self._write_header()

    def _write_header(self) -> None:
        body = self._header_body()
        prefixed = _PREFIX.pack(FILE_MAGIC, FILE_VERSION, len(body)) + body
        header = prefixed + xxhash.xxh3_64_digest(prefixed)
        if len(header) > HEADER_REGION:
            raise ColdTierError(f"cold tier header of {len(header)} bytes does not fit {HEADER_REGION}")
        os.pwrite(self._fd, header, 0)

    def _rebuild_index(self) -> None:
        """Recover the held blocks from their slot records, oldest stamp first."""
        found: dict[bytes, tuple[int, int]] = {}
        for slot in range(self.layout.slot_count):
            record = self._valid_record(slot)
            if record is None:
                continue
            stamp, key = record.stamp, record.key
            if key in found and found[key][0] >= stamp:
                self._invalidate(slot)
                continue
            if key in found:
                self._invalidate(found[key][1])
            found[key] = (stamp, slot)
        for key, (_, slot) in sorted(found.items(), key=lambda item: item[1]):
            self._index[key] = slot
        held = {slot for _, slot in found.values()}
        self._free = [s for s in range(self.layout.slot_count - 1, -1, -1) if s not in held]
        self._next_stamp = max((stamp for stamp, _ in found.values()), default=0) + 1
        if found:
            log.info("cold tier %s: recovered %d blocks", self.path, len(found))

    # ---- slots ------------------------------------------------------------------------

    def _check_block(self, key, keys_np, values_np, token_ids, parent_hash) -> None:
        dtype = self.geometry.numpy_storage_dtype
        for name, array in (("keys", keys_np), ("values", values_np)):
            shape = block_array_shape(self.geometry, name)
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(f"{name} are {array.shape} {array.dtype}, expected {shape} {dtype}")
        if not 0 < len(token_ids) <= self.geometry.block_size:
            raise ValueError(f"a block holds 1..{self.geometry.block_size} tokens, got {len(token_ids)}")
        for name, value in (("key", key), ("parent_hash", parent_hash or b"")):
            if len(value) > MAX_KEY_BYTES:
                raise ValueError(f"{name} of {len(value)} bytes exceeds {MAX_KEY_BYTES}")
        if not key:
            raise ValueError("a cold tier key cannot be empty")

    def _release(self, key: bytes) -> bool:
        """Free `key`'s slot and let the OS reclaim the pages wholly inside it."""
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        self._invalidate(slot)
        self._free.append(slot)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is not None:
            start = self.layout.offset(slot)
            self._advise(advice, start, start + self.layout.stride, outward=False)
        return True

    def _drop_oldest(self, dropped: list[bytes]) -> int:
        key, slot = self._index.popitem(last=False)
        dropped.append(key)
        self._counts["drops"] += 1
        return slot

    def _write_slot(self, slot, key, keys_np, values_np, token_ids, parent_hash) -> None:
        start = self.layout.offset(slot) + self.layout.record_size
        kv_sum = xxhash.xxh3_64()
        for array in (keys_np, values_np):
            raw = memoryview(np.ascontiguousarray(array)).cast("B")
            self._mm[start : start + len(raw)] = raw
            kv_sum.update(raw)
            start += len(raw)
        self._write_record(slot, key, parent_hash, token_ids, kv_sum.intdigest())

    def _write_record(self, slot, key, parent_hash, token_ids, kv_sum: int) -> None:
        tokens = np.asarray(token_ids, dtype="<u4").tobytes().ljust(4 * self.geometry.block_size, b"\0")
        parent = parent_hash or b""
        fields = _RECORD.pack(0, 0, kv_sum, SLOT_MAGIC, parent_hash is not None, len(key), len(parent),
                              len(token_ids), key, parent) + tokens
        record_sum = xxhash.xxh3_64_intdigest(fields[_SUMMED_FROM:])
        stamped = struct.pack("<QQ", self._take_stamp(), record_sum) + fields[_SUMMED_FROM:]
        start = self.layout.offset(slot)
        self._mm[start : start + len(stamped)] = stamped

    def _valid_record(self, slot: int) -> SlotRecord | None:
        start = self.layout.offset(slot)
        raw = self._mm[start : start + _RECORD.size + 4 * self.geometry.block_size]
        record = SlotRecord(*_RECORD.unpack_from(raw), raw[_RECORD.size :])
        if record.magic != SLOT_MAGIC or xxhash.xxh3_64_intdigest(raw[_SUMMED_FROM:]) != record.record_sum:
            return None
        if not 0 < record.n_tokens <= self.geometry.block_size or max(record.key_len, record.parent_len) > MAX_KEY_BYTES:
            return None
        return record

    def _read_slot(self, slot: int, key: bytes) -> KVBlockData | None:
        record = self._valid_record(slot)
        if record is None or record.key != key:
            return None
        start = self.layout.offset(slot) + self.layout.record_size
        keys, values = self._copy_array(start, "keys"), self._copy_array(start + self.layout.key_bytes, "values")
        if _kv_sum(keys, values) != record.kv_sum:
            return None
        return KVBlockData(
            block_hash=key,
            parent_hash=record.parent,
            token_ids=record.token_ids,
            keys=keys,
            values=values,
        )

    def _copy_array(self, start: int, part: str) -> np.ndarray:
        shape = block_array_shape(self.geometry, part)
        view = np.frombuffer(self._mm, dtype=self.geometry.numpy_storage_dtype,
                             count=int(np.prod(shape)), offset=start)
        try:
            return view.reshape(shape).copy()
        finally:
            del view  # release the export so the mmap can close

    def _invalidate(self, slot: int) -> None:
        start = self.layout.offset(slot) + _MAGIC_AT
        self._mm[start : start + len(SLOT_MAGIC)] = bytes(len(SLOT_MAGIC))

    def _take_stamp(self) -> int:
        stamp, self._next_stamp = self._next_stamp, self._next_stamp + 1
        return stamp

    def _stamp(self, slot: int) -> None:
        start = self.layout.offset(slot)
        self._mm[start : start + _STAMP_END] = struct.pack("<Q", self._take_stamp())

    def _advise(self, advice: int, start: int, end: int, *, outward: bool) -> None:
        """madvise over the pages of [start, end): all touched pages, or only those wholly inside."""
        page = mmap.PAGESIZE
        lo = start // page * page if outward else _round_up(start, page)
        hi = _round_up(end, page) if outward else end // page * page
        hi = min(hi, _round_up(self.layout.file_size, page))
        if hi > lo:
            self._mm.madvise(advice, lo, hi - lo)


def _kv_sum(keys: np.ndarray, values: np.ndarray) -> int:
    digest = xxhash.xxh3_64()
    digest.update(memoryview(keys).cast("B"))
    digest.update(memoryview(values).cast("B"))
    return digest.intdigest()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
