"""Chained prefix-block hashes, identical on every process and machine.

`h_i = xxh3_128(h_{i-1} || token ids of block i || extra)`; the chain starts from a root
derived from the model fingerprint and an optional cache salt, so two models (or two
tenants with different salts) never share a block even for identical tokens. Token ids
are packed as little-endian uint32 so the bytes do not depend on the platform, and
Python's `hash()` (salted per process) is never involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

#: A block's chained hash: 16 bytes of xxh3_128.
BlockHash = NewType("BlockHash", bytes)
HASH_SIZE = 16

_ROOT_TAG = b"mlx-orchard/kv-root/v1"


def root_hash(model_fingerprint: str, cache_salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block."""
    h = xxhash.xxh3_128()
    h.update(_ROOT_TAG)
    h.update(model_fingerprint.encode())
    h.update(b"\x00")
    h.update((cache_salt or "").encode())
    return BlockHash(h.digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra:
        h.update(extra)
    return BlockHash(h.digest())


def hash_block_rows(parents: np.ndarray, tokens: np.ndarray) -> bytes:
    """`hash_block` (no extra) of every row at once, the hashes joined: `parents` `[n, 16]` uint8,
    `tokens` `[n, block_size]`. One buffer of all the hashed bytes, then one xxh3 call a block:
    a hash chain of many blocks checked without a Python object per block."""
    if len(parents) == 0:
        return b""
    token_bytes = np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8).reshape(len(tokens), -1)
    rows = np.concatenate([parents, token_bytes], axis=1)
    flat, width = memoryview(rows.reshape(-1)), rows.shape[1]
    return b"".join([xxhash.xxh3_128_digest(flat[i : i + width]) for i in range(0, len(flat), width)])


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: BlockHash, extra: bytes = b""
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; a trailing partial block is not hashed."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
