"""A payload checksummed while it moves, not in a pass of its own.

A link's chunk is a few MiB: checksummed whole before sending and again once received, each
pass reads every byte from memory that the socket's copy reads again (the pool on the way
out, the receive buffer on the way in). Checksumming a slice of a few hundred KiB just before
it is sent, or just after it landed, finds those bytes in the CPU's cache for the other of
the two reads. The bytes and the check are the wire format's (`orchard.kvcache.wire`): the xxh3_128 of
every byte before the last 16, which are that checksum, compared before anything is parsed.

    outgoing = OutgoingPayload(payload_pieces(geometry, blocks))
    for batch in outgoing.batches(max_bytes, max_pieces): send(batch)   # checksummed as handed out
    send(outgoing.checksum())

    incoming = IncomingPayload(buffer[:size])
    recv_into(incoming.data[a:b]); incoming.landed(b)                   # checksummed as it lands
    payload = incoming.decode(geometry)                                  # refused unless it matches

A version 3 payload's size tells where each of its layers lies (`orchard.kvcache.wire_layers.ChunkLayout`),
so once its head has landed the rest can be read straight into pool blocks reserved for it
(`IncomingPayload.place`), checksummed the same way as it lands there.

Either end may take its checksum on a thread of its own (`checksum_thread`), handed each batch or slice as
the link's thread sends it or has landed it and goes on to the next: the checksum then costs the link's
thread nothing, where a core is free to take it. Checksummed on the link's thread, a payload moves at about
half raw TCP's rate on a sixteen-core host, where xxh3 reads memory at 8-13 GB/s and the kernel copies at
5-9; beside it, at 87-94 % of raw TCP's median (docs/benchmarks.md, "## migration",
`experiments/kv_pull_floor.py`). The thread hashes batches in the order they were handed to it, so the
checksum is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait

import numpy as np
import xxhash

from orchard.kvcache import wire_compressed
from orchard.kvcache.block_landing import BlockLanding
from orchard.kvcache.errors import CorruptKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.wire import CHECKSUM_SIZE, KVPayload, _checksum
from orchard.kvcache.wire_layers import TRAILER, ChunkLayout, read_views
from orchard.kvcache.wire_stream import Piece


def checksum_thread(name: str) -> ThreadPoolExecutor:
    """A thread to take checksums beside a link's thread (module docstring): one worker, so that batches
    are hashed in the order they were handed to it."""
    return ThreadPoolExecutor(1, thread_name_prefix=name)


#: Pieces go to the checksum thread in hand-overs of at least this many bytes: each costs the link's thread a
#: future and, where the checksum thread waits, a wake-up, and a pull's pieces may be one layer's K of a run each.
HAND_OVER_BYTES = 512 << 10


class _Digest:
    """A payload's running xxh3_128, taken here or on a checksum thread (`checksum_thread`)."""

    def __init__(self, beside: Executor | None):
        self._digest, self._beside = xxhash.xxh3_128(), beside
        self._held: list[Piece] = []  # taken, not handed over yet
        self._held_bytes = 0
        self._last: Future | None = None  # the checksum thread's last hand-over: it runs after every one before

    def take(self, pieces: Sequence[Piece], last: bool = False) -> None:
        """Add `pieces` (which nothing may write until `settle`) to the checksum, here or on the thread. The
        `last` of a payload are hashed here, when the digest is asked for: handed over, the link's thread
        would wait for the checksum thread to hash them, and to wake it, at every chunk's end."""
        if self._beside is None:
            _update(self._digest, pieces)
            return
        self._held += pieces
        self._held_bytes += sum(map(len, pieces))
        if self._held_bytes >= HAND_OVER_BYTES and not last:
            self._last = self._beside.submit(_update, self._digest, self._held)
            self._held, self._held_bytes = [], 0

    def settle(self) -> None:
        """Return once the checksum thread reads none of the pieces taken (at once where there is none)."""
        if self._last is not None:
            wait([self._last])

    def digest(self) -> bytes:
        if self._last is not None:
            self._last.result()  # raises what the checksum thread raised
        if self._held:  # the last few, here: handed over, they would wait for a wake-up
            _update(self._digest, self._held)
            self._held, self._held_bytes = [], 0
        return self._digest.digest()


def _update(digest, pieces: Sequence[Piece]) -> None:
    for piece in pieces:
        digest.update(piece)


class OutgoingPayload:
    """A payload's pieces (`orchard.kvcache.wire_stream.payload_pieces`: all but the checksum), handed out
    in batches, each checksummed as it goes (here just before, or on `beside`, a `checksum_thread`, meanwhile);
    `checksum()` is the payload's last piece. Call `settle` before the pieces' memory may change, where
    `checksum()` was not reached (a send that failed part way)."""

    def __init__(self, pieces: Sequence[Piece], beside: Executor | None = None):
        self.pieces = pieces
        self.size = sum(map(len, pieces)) + CHECKSUM_SIZE  # the whole payload's, checksum included
        self._digest = _Digest(beside)
        self._handed_out = 0

    def batches(self, max_bytes: int, max_pieces: int) -> Iterator[list[Piece]]:
        """Consecutive runs of the pieces, each at most `max_pieces` and, past its first piece,
        `max_bytes`; each is checksummed when handed out, so send it before asking for the next."""
        i, n = 0, len(self.pieces)
        while i < n:
            batch, nbytes = [self.pieces[i]], len(self.pieces[i])
            i += 1
            while i < n and len(batch) < max_pieces and nbytes + len(self.pieces[i]) <= max_bytes:
                batch.append(self.pieces[i])
                nbytes += len(self.pieces[i])
                i += 1
            self._digest.take(batch, last=i == n)
            self._handed_out = i
            yield batch

    def checksum(self) -> bytes:
        """The payload's last 16 bytes, once every piece was handed out."""
        if self._handed_out != len(self.pieces):
            raise RuntimeError("a payload's checksum is known once all its pieces were handed out")
        return self._digest.digest()

    def settle(self) -> None:
        """Return once the checksum thread, if any, reads none of the pieces any more."""
        self._digest.settle()


class IncomingPayload:
    """A payload received into `buffer` (its exact size, from the link's framing), checksummed as
    its bytes land (here, or on `beside`, a `checksum_thread`, while the next land); `decode` compares that
    checksum before it parses anything. The checksum is of the bytes as they landed: nothing may write the
    buffer between landing and decoding, nor before `settle` where `decode` is not reached."""

    def __init__(self, buffer, beside: Executor | None = None):
        self.data = memoryview(buffer).cast("B")
        self.payload_size = len(self.data)  # the payload's bytes once decoded: more where a frame inflated
        self._digest = _Digest(beside)
        self._landed = 0

    @property
    def landed_bytes(self) -> int:
        """The payload's leading bytes landed so far."""
        return self._landed

    def landed(self, end: int) -> None:
        """The bytes up to `end` have landed (those before it did already): checksum the new ones."""
        if not self._landed <= end <= len(self.data):
            raise ValueError(f"bytes land in order within the payload: {self._landed} landed, then up to {end}")
        covered = max(0, len(self.data) - CHECKSUM_SIZE)  # the checksum does not cover itself
        if self._landed < covered:
            self._digest.take([self.data[self._landed : min(end, covered)]], last=end >= covered)
        self._landed = end

    def settle(self) -> None:
        """Return once the checksum thread, if any, reads none of the landed bytes any more."""
        self._digest.settle()

    def place(self, layout: ChunkLayout, landing: BlockLanding, read_into: Callable[[list[memoryview]], None]) -> bool:
        """Read the rest of a version 3 payload of `layout` straight into the blocks `landing` reserved
        for it, once its first `layout.meta_size` bytes landed here: each layer's K and V with one
        `read_into(pieces)` (fill every piece, in order), checksummed as it lands, the checksum compared
        before the blocks count as landed (`BlockLanding.placing`). The receiver's copy of the KV is then
        the kernel's alone, into the pool. True once placed; False, having read nothing more, where those
        first bytes are not the ones `layout` lays out (another version, another model's geometry): read
        the rest into `data` and `decode` it. Raises `CorruptKVPayload` where the bytes placed do not match
        their checksum, `IncompatibleKVPayload` where they are not the blocks the landing waits for."""
        if self._landed != layout.meta_size or (meta := layout.read_meta(self.data[: self._landed])) is None:
            return False
        try:
            with landing.placing(*meta) as layers:
                for i, (keys, values) in enumerate(layers):
                    self._place_layer(layout, read_into, keys, values, last=i == len(layers) - 1)
                trailer = memoryview(bytearray(len(TRAILER) + CHECKSUM_SIZE))
                read_into([trailer])
                self._digest.take([trailer[: len(TRAILER)]], last=True)
                if trailer[: len(TRAILER)] != TRAILER or self._digest.digest() != trailer[len(TRAILER) :]:
                    raise CorruptKVPayload("KV payload checksum mismatch: the bytes were damaged on the way")
        finally:
            self.settle()  # a landing given up frees its blocks: no thread may still read them
        return True

    def _place_layer(self, layout: ChunkLayout, read_into, keys, values, last: bool) -> None:
        """One layer's K and V read into `placing`'s views, with their headers, checksummed as they landed. The
        headers land in a buffer of their own each layer: the checksum thread may still be reading the last."""
        key_size = len(layout.key_header)
        headers = memoryview(bytearray(key_size + len(layout.value_header)))
        pieces = [headers[:key_size], *map(_bytes_of, keys), headers[key_size:], *map(_bytes_of, values)]
        read_into(pieces)
        if headers != layout.key_header + layout.value_header:
            raise CorruptKVPayload("KV payload of version 3 is not laid out as its size says")
        self._digest.take(pieces, last)

    def decode(self, expected: KVGeometry, expected_state: StateGeometry | None = None,
               inflate_limit: int = 0) -> KVPayload:
        """The payload's blocks (and state) as views into the buffer, as
        `orchard.kvcache.wire_stream.decode_payload_views` reads them (version 3 as
        `orchard.kvcache.wire_layers` does); refused unless every byte landed. A compressed frame
        (`orchard.kvcache.wire_compressed`) of a payload of at most `inflate_limit` bytes is inflated
        first, its payload checked as any; the views are then into the inflated copy."""
        if self._landed != len(self.data):
            raise CorruptKVPayload(f"KV payload ends after {self._landed} of its {len(self.data)} bytes")
        if not wire_compressed.is_compressed(self.data):
            return read_views(self.data, self._digest.digest(), expected, expected_state)
        payload = wire_compressed.inflate(self.data, self._digest.digest(), inflate_limit)
        self.payload_size = len(payload)
        return read_views(memoryview(payload), _checksum(payload), expected, expected_state)


def _bytes_of(rows: np.ndarray) -> memoryview:
    """One of `BlockLanding.placing`'s views as writable bytes."""
    return memoryview(rows).cast("B")
