"""A node's side of KV block migration: export, pull-and-import, and link probes.

Everything touching the KV cache's bookkeeping runs on the engine thread through `AsyncEngine`,
so an export pins and reads its blocks between two steps and no eviction can interleave: it
either gets a block whole or (already evicted) stops the run there. (The direct path's landing
thread writes KV into pool blocks the engine thread reserved for it, which no step touches:
`orchard.kvcache.block_landing`.) Payloads travel in
chunks of at most `chunk_bytes`: encoding slows down sharply above ~16 MiB, and chunks
let the next one travel while the previous one is imported.

The transport is whatever the caller supplies as "fetch a chunk": an awaitable of payload
bytes (a Ray ObjectRef in the actor, a coroutine in tests). A hybrid model's run travels as
one payload: its blocks are worth importing only with the recurrent state after the last of
them, which that payload carries. Any failure while fetching or
importing stops the pull; blocks already imported are whole and verified, so the target
stays consistent and the request recomputes what is missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from orchard.kvcache import KVCache
from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry, StateGeometry
from orchard.kvcache.hashing import BlockHash, hash_block, root_hash
from orchard.kvcache.wire import KVBlockData, decode_blocks, encode_blocks

log = logging.getLogger(__name__)

#: Fetches the payload of a run of block hashes from the source node.
FetchChunk = Callable[[list[BlockHash]], Awaitable[bytes]]

REFUSED_PAYLOAD = (CorruptKVPayload, IncompatibleKVPayload)


@dataclass(frozen=True)
class MigrationConfig:
    chunk_bytes: int = 8 << 20  # the wire encoder holds its speed up to about this size
    probe_bytes: int = 2 << 20  # size of the link probe sent when a node joins


@dataclass
class PullResult:
    """What one pull (or import of handed-over payloads) did; `ok` is False when it broke off."""

    source: str
    requested: int = 0  # blocks asked for
    local: int = 0  # leading blocks the target already held (memory or cold tier)
    imported: int = 0  # blocks written into the pool from payloads
    bytes: int = 0  # payload bytes: the KV and its envelopes, as imported
    wire_bytes: int = 0  # what the direct path carried for them: fewer where chunks came compressed
    seconds: float = 0.0  # from the first fetch to the last import
    ok: bool = True
    error: str = ""
    via: str = "ray"  # the path the bytes took: "ray" (object store) or "direct" (`orchard.node.serving.kv_link`)

    @property
    def bytes_per_s(self) -> float | None:
        """Effective rate of the whole move (export, transfer, import): what routing compares."""
        return self.bytes / self.seconds if self.bytes and self.seconds > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_s": self.bytes_per_s}


def local_prefix(kv: KVCache, hashes: Sequence[BlockHash]) -> int:
    """Leading blocks of `hashes` this cache holds in memory or in its cold tier (engine thread)."""
    count = 0
    for block_hash in hashes:
        if kv.manager.cached_block(block_hash) is None and (kv.cold is None or block_hash not in kv.cold):
            break
        count += 1
    return count


def chunked(hashes: Sequence[BlockHash], bytes_per_block: int, chunk_bytes: int) -> list[list[BlockHash]]:
    """Consecutive runs of `hashes`, each at most `chunk_bytes` (and at least one block)."""
    per_chunk = max(1, chunk_bytes // max(1, bytes_per_block))
    return [list(hashes[i : i + per_chunk]) for i in range(0, len(hashes), per_chunk)]


def probe_payload(geometry: KVGeometry, nbytes: int) -> bytes:
    """A well-formed payload of about `nbytes` whose blocks chain from a root no model uses.

    Decoding it costs what a real payload costs, so a probe measures the effective rate a
    migration would see; importing it could never produce a prefix hit.
    """
    count = max(1, nbytes // geometry.bytes_per_block)
    zero_keys = np.zeros((geometry.num_layers, *geometry.key_block_shape), dtype=geometry.numpy_storage_dtype)
    zero_values = np.zeros((geometry.num_layers, *geometry.value_block_shape), dtype=geometry.numpy_storage_dtype)
    parent = root_hash("orchard-link-probe")
    blocks = []
    for i in range(count):
        tokens = tuple([i] * geometry.block_size)
        block_hash = hash_block(parent, tokens)
        blocks.append(KVBlockData(block_hash, parent, tokens, zero_keys, zero_values))
        parent = block_hash
    return encode_blocks(geometry, blocks)


@dataclass
class MigrationCounters:
    migrated_blocks: int = 0
    migration_failures: int = 0
    migrated_bytes: int = 0


class BlockMover:
    """Export and import for one engine, counting what moved and what was refused."""

    def __init__(self, engine, config: MigrationConfig | None = None):
        self.engine = engine  # an AsyncEngine
        self.config = config or MigrationConfig()
        self.counters = MigrationCounters()

    @property
    def geometry(self) -> KVGeometry:
        return self.engine.engine.kv.geometry

    @property
    def state_geometry(self) -> StateGeometry | None:
        """A hybrid model's state pool geometry; None for a model without recurrent state."""
        return self.engine.engine.kv.state_geometry

    async def export(self, hashes: Sequence[BlockHash]) -> bytes:
        hashes = [BlockHash(bytes(h)) for h in hashes]
        return await self.engine.run_on_engine(lambda engine: engine.export_blocks(hashes))

    async def pull(self, fetch: FetchChunk, source: str, hashes: Sequence[BlockHash]) -> PullResult:
        """Fetch from `source` the blocks of `hashes` not held here and import them in chain order."""
        hashes = [BlockHash(bytes(h)) for h in hashes]
        local = await self.engine.run_on_engine(lambda engine: local_prefix(engine.kv, hashes))
        wanted = hashes[local:]
        result = PullResult(source, requested=len(hashes), local=local)
        if not wanted:
            return result
        chunks = [wanted] if self.state_geometry is not None else chunked(wanted, self.geometry.bytes_per_block,
                                                                          self.config.chunk_bytes)
        started = time.perf_counter()
        try:
            pending = [asyncio.ensure_future(fetch(chunk)) for chunk in chunks]
        except Exception as exc:  # the source could not even be asked
            return self._failed(result, exc)
        return await self._import_in_order(pending, [len(c) for c in chunks], result, started)

    async def import_payloads(self, payloads: Sequence[Awaitable[bytes]], source: str) -> PullResult:
        """Import payloads someone else fetched (or is fetching), in the order given."""
        result = PullResult(source)
        pending = [asyncio.ensure_future(p) for p in payloads]
        return await self._import_in_order(pending, [None] * len(pending), result, time.perf_counter())

    async def probe(self, payload: Awaitable[bytes]) -> tuple[int, float]:
        """(bytes, seconds) of fetching and decoding a probe payload from a peer."""
        started = time.perf_counter()
        data = await payload
        decode_blocks(data, self.geometry)
        return len(data), time.perf_counter() - started

    def probe_sizes(self) -> tuple[int, int]:
        """One block (the fixed cost shows) and `probe_bytes` (the rate shows)."""
        return self.geometry.bytes_per_block, max(self.config.probe_bytes, 2 * self.geometry.bytes_per_block)

    def make_probe(self, nbytes: int) -> bytes:
        return probe_payload(self.geometry, nbytes)

    # ---- internals -----------------------------------------------------------------
    async def _import_in_order(self, pending, sizes, result: PullResult, started: float) -> PullResult:
        try:
            for future, size in zip(pending, sizes):
                payload = await future
                result.bytes += len(payload)
                imported = await self.engine.run_on_engine(lambda engine, p=payload: engine.import_blocks(p))
                result.imported += imported
                if size is not None and imported < size:
                    break  # the source no longer held the rest, or our pool is full
            result.seconds = time.perf_counter() - started
        except Exception as exc:  # refused payload, or the source died mid-transfer
            self._failed(result, exc)
        finally:
            for future in pending:
                future.cancel()
        self.counters.migrated_blocks += result.imported
        self.counters.migrated_bytes += result.bytes
        return result

    def _failed(self, result: PullResult, exc: BaseException) -> PullResult:
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"
        self.counters.migration_failures += 1
        level = logging.WARNING if isinstance(exc, REFUSED_PAYLOAD) else logging.INFO
        log.log(level, "KV pull from %s broke off after %d blocks: %s", result.source, result.imported, result.error)
        return result
