"""A whole payload as pieces, its checksum taken here, apart from the product's transit code: the bytes
the link's sender (`orchard.kvcache.wire_transit.OutgoingPayload`) must put on the wire, and that readers must read."""

from __future__ import annotations

import xxhash

from orchard.kvcache.wire_stream import payload_pieces


def encode_pieces(geometry, blocks, state=None) -> list:
    """`payload_pieces` and, last, the wire format's checksum: the xxh3_128 of every byte before it."""
    pieces = payload_pieces(geometry, blocks, state)
    return [*pieces, xxhash.xxh3_128_digest(b"".join(bytes(p) for p in pieces))]
