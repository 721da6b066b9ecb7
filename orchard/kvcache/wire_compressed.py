"""A link's chunk compressed for a slow link: any wire payload, split into byte planes, in one zstd frame.

KV is floating point. The high byte of each element (sign and exponent) repeats across a block;
the low bytes barely do. Laid out byte plane by byte plane (every element's first byte, then
every element's second, ...), a payload shrinks under zstd's fastest level; how far depends on
the dtype (docs/benchmarks.md, "## migration"). Lossless: the payload that comes out is the one
that went in, bit for bit, so the KV that lands is exact.

It pays only where the link, not the CPU, sets a pull's pace: compressing runs at a few hundred
MB/s a core, so a 1 Gbit/s link gains and a 10 Gbit/s one would lose. A pull asks for it
(`orchard.node.serving.direct_path`, which decides from the rate of the last pull).

    frame   MAGIC (4 bytes) | version u8 | element width u8 | payload size u64 | zstd frame | checksum (16)

The checksum is xxh3_128 of every byte before it, taken as the frame is sent and as it lands
(`orchard.kvcache.wire_transit`), as for an uncompressed payload. The payload inside is a whole
`orchard.kvcache.wire` (or `wire_layers`) payload with its own checksum, read and checked after
inflating exactly as an uncompressed one is. MAGIC starts with 0xc1, a byte msgpack never
writes, so a frame cannot be taken for a payload nor a payload for a frame. A reader refuses a
frame whose payload size is past its limit or differs from the size the zstd frame declares,
before it inflates anything: a frame of a few bytes cannot make it allocate more than its limit.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from orchard.kvcache.errors import CorruptKVPayload
from orchard.kvcache.wire import CHECKSUM_SIZE, _checksum

MAGIC = b"\xc1OKZ"
VERSION = 1
_HEADER = struct.Struct(">4sBBQ")
HEADER_SIZE = _HEADER.size
LEVEL = 1  # zstd's fastest: a slow link is the reason to compress, a slow compressor would undo it
WIDTHS = (1, 2, 4)


def compressed_pieces(pieces: list, width: int) -> list[bytes]:
    """The frame of the payload `pieces` make (`orchard.kvcache.wire_stream.payload_pieces` or
    `orchard.kvcache.wire_layers.layer_pieces`: all but the payload's checksum, which is added here)
    but for the frame's own checksum, which the sender takes as it sends (`link_io.send_payload`).
    `width`: bytes an element of the payload's KV holds."""
    if width not in WIDTHS:
        raise ValueError(f"an element is {WIDTHS} bytes wide, not {width}")
    payload = bytearray(b"".join(pieces)) + bytes(CHECKSUM_SIZE)
    payload[-CHECKSUM_SIZE:] = _checksum(payload)
    body = zstandard.ZstdCompressor(level=LEVEL).compress(_planes(payload, width))
    return [_HEADER.pack(MAGIC, VERSION, width, len(payload)), body]


def is_compressed(data) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def inflate(data: memoryview, digest: bytes, limit: int) -> bytearray:
    """The payload inside the frame `data` whose checksum, taken as it landed, is `digest`;
    refused (`CorruptKVPayload`) unless the checksum matches and the header is whole, known and
    within `limit` bytes of payload."""
    if len(data) < HEADER_SIZE + CHECKSUM_SIZE:
        raise CorruptKVPayload(f"compressed KV frame of {len(data)} bytes is too short to hold anything")
    if digest != bytes(data[-CHECKSUM_SIZE:]):
        raise CorruptKVPayload("compressed KV frame checksum mismatch: the bytes were damaged on the way")
    magic, version, width, size = _HEADER.unpack(data[:HEADER_SIZE])
    if magic != MAGIC or version != VERSION or width not in WIDTHS:
        raise CorruptKVPayload(f"compressed KV frame of version {version}, width {width}: not one this reader knows")
    body = data[HEADER_SIZE:-CHECKSUM_SIZE]
    if not 0 < size <= limit:
        raise CorruptKVPayload(f"compressed KV frame holds {size} bytes, past this reader's limit of {limit}")
    try:
        if zstandard.frame_content_size(body) != size:
            raise CorruptKVPayload("compressed KV frame's size differs from its zstd frame's")
        planes = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
    except zstandard.ZstdError as err:
        raise CorruptKVPayload(f"compressed KV frame does not inflate: {err}") from err
    if len(planes) != size:
        raise CorruptKVPayload(f"compressed KV frame inflated to {len(planes)} bytes, not {size}")
    return _interleaved(planes, width)


def _planes(data: bytearray, width: int) -> bytes:
    """`data`'s whole elements of `width` bytes as byte planes, then the bytes past the last whole one."""
    whole = len(data) // width * width
    rows = np.frombuffer(data, np.uint8, count=whole).reshape(-1, width)
    return rows.T.tobytes() + bytes(data[whole:])


def _interleaved(planes: bytes, width: int) -> bytearray:
    """`_planes` undone."""
    out = bytearray(len(planes))
    whole = len(planes) // width * width
    np.frombuffer(out, np.uint8, count=whole).reshape(-1, width)[:] = (
        np.frombuffer(planes, np.uint8, count=whole).reshape(width, -1).T)
    out[whole:] = planes[whole:]
    return out
