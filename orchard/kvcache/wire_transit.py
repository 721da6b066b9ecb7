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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from orchard.kvcache import wire_compressed
from orchard.kvcache.block_landing import BlockLanding
from orchard.kvcache.errors import CorruptKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.wire import CHECKSUM_SIZE, KVPayload, _checksum
from orchard.kvcache.wire_layers import TRAILER, ChunkLayout, read_views
from orchard.kvcache.wire_stream import Piece


class OutgoingPayload:
    """A payload's pieces (`orchard.kvcache.wire_stream.payload_pieces`: all but the checksum), handed out
    in batches, each checksummed just before it goes; `checksum()` is the payload's last piece."""

    def __init__(self, pieces: Sequence[Piece]):
        self.pieces = pieces
        self.size = sum(map(len, pieces)) + CHECKSUM_SIZE  # the whole payload's, checksum included
        self._digest = xxhash.xxh3_128()
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
            for piece in batch:
                self._digest.update(piece)
            self._handed_out = i
            yield batch

    def checksum(self) -> bytes:
        """The payload's last 16 bytes, once every piece was handed out."""
        if self._handed_out != len(self.pieces):
            raise RuntimeError("a payload's checksum is known once all its pieces were handed out")
        return self._digest.digest()


class IncomingPayload:
    """A payload received into `buffer` (its exact size, from the link's framing), checksummed as
    its bytes land; `decode` compares that checksum before it parses anything. The checksum is of
    the bytes as they landed: nothing may write the buffer between landing and decoding."""

    def __init__(self, buffer):
        self.data = memoryview(buffer).cast("B")
        self.payload_size = len(self.data)  # the payload's bytes once decoded: more where a frame inflated
        self._digest = xxhash.xxh3_128()
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
            self._digest.update(self.data[self._landed : min(end, covered)])
        self._landed = end

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
        headers = memoryview(bytearray(len(layout.key_header) + len(layout.value_header)))
        key_header, value_header = headers[: len(layout.key_header)], headers[len(layout.key_header) :]
        with landing.placing(*meta) as layers:
            for keys, values in layers:
                pieces = [key_header, *map(_bytes_of, keys), value_header, *map(_bytes_of, values)]
                read_into(pieces)
                if headers != layout.key_header + layout.value_header:
                    raise CorruptKVPayload("KV payload of version 3 is not laid out as its size says")
                for piece in pieces:
                    self._digest.update(piece)
            trailer = memoryview(bytearray(len(TRAILER) + CHECKSUM_SIZE))
            read_into([trailer])
            self._digest.update(trailer[: len(TRAILER)])
            if trailer[: len(TRAILER)] != TRAILER or self._digest.digest() != trailer[len(TRAILER) :]:
                raise CorruptKVPayload("KV payload checksum mismatch: the bytes were damaged on the way")
        return True

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
