"""A node's two ends of the direct KV path: its listener, and pulls that use a peer's.

`DirectPath.pull` answers None when no direct path can be made (no key, no address known
for the source, nothing listening there, a handshake refused): the caller then pulls
through Ray. Once the source has started replying, whatever goes wrong is a failed pull
like any other (counted; the blocks imported so far are whole and verified; the request
recomputes the rest), never a second try over Ray.

A pull asks for compressed chunks (`orchard.kvcache.wire_compressed`) as `KVLinkConfig.compress` says:
by default where the link from the same source carried its last long enough pull slower than a
compressor runs, which is to say where the link, not the CPU, sets a pull's pace; every fifth such pull
in a row goes plain, to read the link again (`compress_next`).

Where the pool lives in memory numpy can address (the CPU, a Mac's unified memory), a pull's blocks
land straight in pool blocks the engine thread reserved before the first chunk is taken, and the engine
lists them as cached (`orchard.kvcache.block_landing`) in one call at the end, which the receive thread runs
itself where the engine idles (`AsyncEngine.call_here_if_idle`: no thread is woken for it); a stepping
engine also in calls queued as chunks land, which it takes between two steps while the pull goes on: a
pull into a stepping engine waits for two steps at most, not a step per chunk, and takes no copy from
the steps' thread.
A plain chunk is read by the receive thread from the socket into those blocks, checked as its bytes
land (`orchard.kvcache.wire_transit.IncomingPayload.place`): the kernel's copy is the only one this end
makes. A compressed chunk is inflated into a buffer first; while the engine steps, a landing thread
copies it into the reserved blocks as the next one arrives; into an idle engine, its thread imports
each as it arrives.

A plain pull of more than one chunk goes over several connections at once where the process has the
cores (`KVLinkConfig.connections_per_pull`): its run in consecutive parts of whole chunks, one a
connection, each read by its connection's receive thread into its own part of the landing
(`BlockLanding.parts`), so that copying and checksumming the bytes is not one thread's work at each end.
Such a pull asks for no more chunks than it has connections, where `KVLinkConfig.chunk_bytes` allows: its
bytes land layer by layer as they come whatever the chunk's size, and each chunk costs both ends a fixed
amount of work in the interpreter (laying it out, checking its blocks, listing them). A pull whose chunks are
imported or copied once whole asks for eight, so that one is written while the next arrives (`chunk_size`).

A connection whose reply ended whole is kept for the next pull from the same source (as many as a pull
uses, for half the listener's idle timeout): a pull of a few MiB otherwise spends as long connecting and
proving the key as moving its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain

from orchard.kvcache.block_landing import BlockLanding, LandingPart
from orchard.kvcache.hashing import BlockHash
from orchard.kvcache.pool import host_memory
from orchard.kvcache.wire import KVPayload
from orchard.node.serving.kv_link import RATE_MIN_BYTES, KVLinkConfig, KVLinkServer, LinkStream, connect
from orchard.node.serving.link_auth import LinkRefused
from orchard.node.serving.migration import BlockMover, PullResult, chunked, local_prefix

log = logging.getLogger(__name__)

#: Where a node's listener is: the coordinator's answer for a node id, "host:port" or None.
Resolve = Callable[[str], Awaitable[str | None]]


class DirectPath:
    def __init__(self, mover: BlockMover, node_id: str, key: bytes | None, config: KVLinkConfig | None = None):
        self.mover, self.node_id, self.key = mover, node_id, key
        self.config = config or KVLinkConfig()
        self.server: KVLinkServer | None = None
        self._addresses: dict[str, str] = {}
        self._buffers: list[bytearray] = []  # receive buffers kept across pulls: no page faults on the next
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # per source: connections, when each was left
        self._link_rates: dict[str, float] = {}  # per source: the link's bytes/s in the last pull that tells
        self._compressed_in_a_row: dict[str, int] = {}  # per source: pulls asked compressed since the last plain one
        self._lander = ThreadPoolExecutor(1, thread_name_prefix="kv-land")  # writes landing chunks into the pool

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    @property
    def refused(self) -> int:
        """Connections to our listener that did not prove the key."""
        return self.server.counters.refused if self.server is not None else 0

    @property
    def accepted(self) -> int:
        """Connections to our listener that proved the key."""
        return self.server.counters.accepted if self.server is not None else 0

    def start(self) -> str | None:
        """Listen (only when a key is set); returns "host:port" or None."""
        if self.key is None or self.server is not None:
            return self.address
        self.server = KVLinkServer(self.key, self.node_id, self.mover.geometry, self._export, self._release, self.config,
                                   export_layers=self._export_layers)
        address = self.server.start()
        self.server.prepare_probes(self.mover.probe_sizes())
        return address

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for kept in self._idle.values():
            for sock, _ in kept:
                sock.close()
        self._idle.clear()
        self._lander.shutdown(wait=False)

    async def pull(self, source_id: str, hashes: Sequence[BlockHash], resolve: Resolve) -> PullResult | None:
        """Pull the blocks of `hashes` this node lacks from `source_id`'s listener, or None (see above).

        Over a kept connection the request goes first, for the whole run, and the engine looks up what is held
        here, reserves the blocks and hands the stream its sink while the source pins and sends: that work is
        off the pull's path, and the receive thread takes the first chunk without waiting for the event loop
        to wake (docs/benchmarks.md, "Asking first"). An idle engine does it on this, the loop's, thread
        (`AsyncEngine.run_on_engine`'s `here_if_idle`; not with a cold tier, `_plans_here_if_idle`): its thread
        is not woken for it. Where this node turns out to hold a leading part of the run, or has room for less
        of it, that stream is dropped and the blocks it lacks are asked for again on a new connection. The KV
        events of the reservation (blocks evicted for it) go with the pull's closing engine call, in one
        hand-over: a node actor sends each to the coordinator in a Ray call, which would otherwise come in the
        middle of the pull."""
        started = time.perf_counter()  # the fixed cost a pull pays counts from here: lookup, hops, handshake
        address = await self._address(source_id, resolve)
        if address is None or self.key is None:
            return None
        hashes = [BlockHash(bytes(h)) for h in hashes]
        engine = self.mover.engine
        compress = self.compress_next(source_id)
        result = PullResult(source_id, requested=len(hashes), via="direct")
        asked = self._ask_kept(source_id, hashes, compress)
        try:
            landing, wanted, sink = await engine.run_on_engine(
                lambda e: self._plan_and_take(e, hashes, compress, result, asked), publish=False,
                here_if_idle=_plans_here_if_idle(engine))
        except BaseException:
            for stream in asked:
                stream.close()
            raise
        if asked and sink is None:  # it asked for blocks held here, or for more than there is room for
            for stream in asked:
                await self._drop(stream)
            asked = []
        if not wanted:
            return result
        streams = asked or await self._ask_new(source_id, address, wanted, compress, split=landing is not None)
        if not streams:
            if landing is not None:
                await engine.run_on_engine(lambda e: landing.release())
            return None
        return await self._receive(source_id, streams, sink or self._take(streams, landing, result, compress), result, started)

    def compress_next(self, source_id: str) -> bool:
        """Whether the pull from `source_id` about to be asked for goes compressed (`KVLinkConfig.compress`);
        the answer counts that pull, so ask once a pull. Under "auto", every `RECHECK_AFTER + 1`-th pull in a
        row that would be compressed goes plain instead: a compressed reply's pace is the slower of the link
        and the source's compressor, so on a fast link whose one reading came out slow (its cores busy
        meanwhile) compressed pulls would otherwise tell too slow a rate, pull after pull, at a tenth of the
        link's speed; a plain one tells the link's."""
        if self.config.compress != "auto":
            return self.config.compress == "always"
        rate = self._link_rates.get(source_id)
        if rate is None or rate >= self.config.compress_below_bytes_per_s:
            self._compressed_in_a_row.pop(source_id, None)
            return False
        in_a_row = self._compressed_in_a_row.get(source_id, 0)
        self._compressed_in_a_row[source_id] = (in_a_row + 1) % (RECHECK_AFTER + 1)
        return in_a_row < RECHECK_AFTER

    def _learn_link_rate(self, source_id: str, streams: Sequence[LinkStream]) -> None:
        """Keep the link's rate a finished reply tells (`LinkStream.link_rate`, once its connections carried
        `RATE_MIN_BYTES` between them: the sum of theirs, for they shared the link at once), for `compress_next`."""
        if sum(stream.wire_bytes for stream in streams) < RATE_MIN_BYTES:
            return
        rates = [stream.link_rate(min_bytes=0) for stream in streams]
        if None not in rates:
            self._link_rates[source_id] = sum(rates)

    async def probe(self, source_id: str, nbytes: int, resolve: Resolve) -> tuple[int, float] | None:
        """(bytes, seconds) of fetching and verifying a probe payload over the direct path, or None. A probe
        long enough to tell the link's rate (`LinkStream.link_rate`) tells `compress_next` too, so the first
        pull over a slow link (a node probes each peer's link as it joins) already goes compressed."""
        started = time.perf_counter()
        address = await self._address(source_id, resolve)
        sock = None if address is None or self.key is None else await self._connect(source_id, address)
        if sock is None:
            return None
        stream = LinkStream(sock, [bytearray()], self.mover.geometry)
        stream.take(None)
        received = 0
        try:
            stream.start([], 0, probe_bytes=nbytes)
            async for buffer, size, _ in stream.chunks():
                received += size
                stream.done(buffer)
        finally:
            stream.close()
        self._learn_link_rate(source_id, [stream])
        return received, time.perf_counter() - started

    async def _connect(self, source_id: str, address: str):
        try:
            return await asyncio.to_thread(connect, address, self.key, source_id, self.config)
        except (OSError, LinkRefused) as exc:
            log.info("node %s: no direct KV path to %s at %s (%s); using Ray", self.node_id, source_id, address, exc)
            self._addresses.pop(source_id, None)
            return None

    def _kept(self, source_id: str, most: int) -> list[socket.socket]:
        """Up to `most` of the connections the last pulls from `source_id` left that are still open and fresh
        (taken; the others fresh stay kept, the stale are closed)."""
        fresh = []
        for sock, left in self._idle.pop(source_id, []):
            if time.monotonic() - left < self.config.io_timeout_s / 2 and _open(sock):
                fresh.append((sock, left))
            else:
                sock.close()
        if fresh[most:]:
            self._idle[source_id] = fresh[most:]
        return [sock for sock, _ in fresh[:most]]

    def _keep(self, source_id: str, socks: Sequence[socket.socket]) -> None:
        """Keep connections whose replies ended whole for the next pulls from `source_id`."""
        self._idle.setdefault(source_id, []).extend((sock, time.monotonic()) for sock in socks)

    def _parts(self, hashes: list[BlockHash], compress: bool, split: bool = True) -> list[list[BlockHash]]:
        """`hashes` in the consecutive parts a pull asks for, a connection each (`KVLinkConfig.connections_per_pull`):
        whole chunks each, as near equal as chunks allow, no more parts than chunks. One unless `split`; one for
        compressed chunks, whose pace is the link's; one for a hybrid model's run, which is one chunk; one where
        the pool is not in host memory, whose chunks are imported by the engine thread in the order they come
        (a landing takes parts in any order: `BlockLanding.parts`)."""
        connections = self.config.pull_connections()
        if connections == 1 or not self._lands_in_place(compress, split):
            return [hashes]
        chunks = chunked(hashes, self.mover.geometry.bytes_per_block, self._chunk_bytes(hashes, True))  # as the source cuts them
        per_part = -(-len(chunks) // connections)  # chunks a part, rounded up
        return [list(chain.from_iterable(chunks[i : i + per_part])) for i in range(0, len(chunks), per_part)]

    def _lands_in_place(self, compress: bool, landing: bool = True) -> bool:
        """Whether a pull's chunks are read straight into the blocks reserved for them (`LinkStream.take`'s
        landing): plain chunks, no recurrent state, a pool in host memory, and blocks reserved (`landing`: False
        where the engine reserved none)."""
        return landing and not compress and self.mover.state_geometry is None and host_memory()

    def _chunk_bytes(self, hashes: Sequence[BlockHash], placed: bool) -> int:
        """The chunk size a pull of `hashes` asks for (`chunk_size`). Chunks read straight into the pool
        (`placed`) need no more of them than the connections the pull is spread over: a chunk's bytes land
        layer by layer as they come, and each chunk costs both ends a fixed amount of work. Chunks imported
        or copied once whole need several, so that one is written while the next arrives."""
        chunks = self.config.pull_connections() if placed else CHUNKS_PER_PULL
        return chunk_size(len(hashes) * self.mover.geometry.bytes_per_block, self.config.chunk_bytes, chunks,
                          self.mover.geometry.bytes_per_block)

    def _ask_kept(self, source_id: str, hashes: list[BlockHash], compress: bool) -> list[LinkStream]:
        """Streams asking for `hashes`' parts (`_parts`) over connections the last pulls from `source_id`
        left, where they left one for each part, their chunks held until `take`; else none."""
        parts = self._parts(hashes, compress)
        kept = self._kept(source_id, len(parts))
        if len(kept) < len(parts):
            self._keep(source_id, kept)
            return []
        return self._ask_parts(source_id, kept, parts, self._chunk_bytes(hashes, self._lands_in_place(compress)), compress)

    async def _ask_new(self, source_id: str, address: str, hashes: list[BlockHash], compress: bool,
                       split: bool) -> list[LinkStream]:
        """Streams asking for `hashes`' parts (`_parts`) over kept connections and new ones, or none where a
        connection cannot be made."""
        parts = self._parts(hashes, compress, split)
        socks = self._kept(source_id, len(parts))
        made = await asyncio.gather(*(self._connect(source_id, address) for _ in range(len(parts) - len(socks))))
        socks += [sock for sock in made if sock is not None]
        if len(socks) < len(parts):
            for sock in socks:
                sock.close()
            return []
        return self._ask_parts(source_id, socks, parts, self._chunk_bytes(hashes, self._lands_in_place(compress, split)), compress)

    def _ask_parts(self, source_id: str, socks: list[socket.socket], parts: list[list[BlockHash]], chunk_bytes: int,
                   compress: bool) -> list[LinkStream]:
        """A stream a part, each over its connection, or none where a request could not be sent: the streams
        that asked already are closed, the connections not asked on yet kept for the next pull."""
        streams = []
        for at, (sock, part) in enumerate(zip(socks, parts)):
            stream = self._ask(sock, part, chunk_bytes, compress)
            if stream is None:
                for asked in streams:
                    asked.close()
                    self._buffers.extend(asked.buffers)
                self._keep(source_id, socks[at + 1 :])
                return []
            streams.append(stream)
        return streams

    def _ask(self, sock: socket.socket, hashes: list[BlockHash], chunk_bytes: int, compress: bool) -> LinkStream | None:
        """A stream whose request for `hashes` went, its chunks held until `take`; None, the connection
        closed, where the request could not be sent (the source went away): nothing was asked yet."""
        buffers = [self._buffers.pop() if self._buffers else bytearray() for _ in range(4)]  # arriving, queued, importing
        stream = LinkStream(sock, buffers, self.mover.geometry, state_geometry=self.mover.state_geometry,
                            kept_thread=self.config.receives_on_kept_threads())
        try:
            stream.start(hashes, chunk_bytes, compress=compress)
        except OSError as exc:
            log.info("node %s: a KV link request could not be sent (%s)", self.node_id, exc)
            stream.close()
            self._buffers.extend(buffers)
            return None
        return stream

    async def _drop(self, stream: LinkStream) -> None:
        """Give up a stream whose reply nobody takes: its connection closed, its buffers kept."""
        stream.close()
        await stream.stopped()
        self._buffers.extend(stream.buffers)

    def _plan_and_take(self, engine, hashes: list[BlockHash], compress: bool, result: PullResult,
                       asked: list[LinkStream]) -> tuple[BlockLanding | None, list[BlockHash], _Sink | None]:
        """(`_plan`'s landing, the blocks to ask for: those not held here, as many as the landing has room
        for, the sink given to `asked` or None) (engine thread): where `asked` asked for just those, and in
        parts only where they land in a landing, its chunks' sink, given to it from here."""
        result.local, landing = _plan(engine, hashes, places=not compress)
        wanted = hashes[result.local :][: landing.capacity if landing is not None else None]
        if not asked or len(wanted) != len(hashes) or (landing is None and len(asked) > 1):
            return landing, wanted, None
        return landing, wanted, self._take(asked, landing, result, compress)

    def _take(self, streams: list[LinkStream], landing: BlockLanding | None, result: PullResult, compress: bool) -> _Sink:
        """The sink of the streams' chunks, given to each: landed in `landing`, each stream's in its part
        (read straight into its blocks where they come plain), else imported by the engine thread."""
        engine = self.mover.engine
        if landing is None:
            sink = _ChunkImporter(engine, result, streams)
            for stream in streams:
                stream.take(_StreamSink(sink, stream, None))
            return sink
        sink = _ChunkLander(landing, result, self._lander, engine, streams)
        places = not compress and landing.places_wire_bytes
        for stream, part in zip(streams, landing.parts([stream.asked_blocks for stream in streams])):
            stream.take(_StreamSink(sink, stream, part), part if places else None)
        return sink

    async def _receive(self, source_id: str, streams: list[LinkStream], sink: _Sink, result: PullResult,
                       started: float) -> PullResult:
        try:
            try:
                await asyncio.wrap_future(sink.finished)  # every reply ended and the engine ran `finish`
            finally:
                for stream in streams:  # at once where it ended; else it is closed (the pull given up part way)
                    await stream.stopped()
                if not sink.finished.done():
                    await asyncio.wrap_future(sink.finished)  # the streams told the sink the end as they stopped
            if (failure := sink.error or sink.failure) is not None:
                raise failure
            result.seconds = time.perf_counter() - started
            self._learn_link_rate(source_id, streams)
        except Exception as exc:  # a refused payload, or the source went away mid-reply
            self.mover._failed(result, sink.error or exc)
        finally:
            self._keep(source_id, [sock for sock in (stream.release() for stream in streams) if sock is not None])
            for stream in streams:
                self._buffers.extend(stream.buffers)
            result.wire_bytes = sum(stream.wire_bytes for stream in streams)
        self.mover.counters.migrated_blocks += result.imported
        self.mover.counters.migrated_bytes += result.bytes
        return result

    async def _address(self, source_id: str, resolve: Resolve) -> str | None:
        if source_id not in self._addresses:
            try:
                address = await resolve(source_id)
            except Exception as exc:  # the coordinator away: Ray still works
                log.info("node %s: no KV link address for %s: %s", self.node_id, source_id, exc)
                return None
            if not address:
                return None
            self._addresses[source_id] = address
        return self._addresses[source_id]

    def _export(self, hashes: list[BlockHash]):  # a link thread
        """Pin the run for wire format version 2 on the engine thread: for a hybrid model that copies its state
        out through MLX, which evaluates an array only on the thread whose stream made it."""
        return self._on_engine(lambda e: e.kv.pin_export(hashes), here_if_idle=False)

    def _export_layers(self, hashes: list[BlockHash]):  # a link thread
        """Pin the run for the layer-major format: bookkeeping and views of the pool, here where the engine idles."""
        return self._on_engine(lambda e: e.kv.pin_layer_export(hashes), here_if_idle=True)

    def _release(self, pinned) -> None:  # a link thread
        """Unpin a sent run: here where the engine idles (`AsyncEngine.call_here_if_idle`), else queued on the
        engine thread and not waited for, the link's thread sending the reply's end marker and reading the next
        request meanwhile; every later call on the engine runs after this one."""
        self.mover.engine.call_here_if_idle(lambda e: e.kv.unpin_export(pinned), self._released)

    def _released(self, _result, exc: Exception | None) -> None:  # the engine's turn
        if exc is not None:
            log.error("node %s: a sent run could not be unpinned: %s", self.node_id, exc)

    def _on_engine(self, fn, here_if_idle: bool):
        """`fn(engine)` on the engine thread, or with `here_if_idle` on the calling (link) thread where the engine
        idles (`AsyncEngine.call_here_if_idle`), waited for here: no event loop in between, so a pull's source
        side does not wait for a busy actor's loop to wake, nor, where it may, for an idle engine thread to."""
        done: Future = Future()
        engine = self.mover.engine
        call = engine.call_here_if_idle if here_if_idle else engine.call_from_thread
        call(fn, lambda result, exc: done.set_result(result) if exc is None else done.set_exception(exc))
        return done.result(self.config.io_timeout_s)


#: Under "auto", compressed pulls from one source before a plain one re-reads its link (`compress_next`).
RECHECK_AFTER = 4

#: A pull whose chunks are imported or copied once whole is cut into at least this many chunks where
#: `MIN_CHUNK_BYTES` allows: one chunk's decode and pool write are not overlapped with anything (the
#: pipeline filling and draining), so they should be a small part of the pull.
CHUNKS_PER_PULL = 8
MIN_CHUNK_BYTES = 1 << 20


def chunk_size(pull_bytes: int, largest: int, chunks: int = CHUNKS_PER_PULL, block_bytes: int = 1) -> int:
    """The chunk size a pull of `pull_bytes` asks for: `largest`, or less for a small pull, cut into `chunks`
    of whole blocks of `block_bytes` (the last the shortest), none below `MIN_CHUNK_BYTES`."""
    blocks = -(-pull_bytes // block_bytes)
    return min(largest, max(MIN_CHUNK_BYTES, -(-blocks // chunks) * block_bytes))


def _open(sock: socket.socket) -> bool:
    """Whether a kept connection is still open with nothing unread (the peer may have closed it)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # nothing to read: open and idle
    except OSError:
        return False
    return False  # closed by the peer (b""), or bytes nobody asked for


def _plan(engine, hashes: list[BlockHash], places: bool):
    """(leading blocks of `hashes` held here, blocks reserved for the rest to land in or None) (engine thread).

    Blocks land off the engine thread where the receive thread can read them straight into the pool
    (`places`: chunks not compressed), or while the engine is stepping, where each chunk imported would wait
    for the step in progress (docs/benchmarks.md, "Pulls into a node that is decoding"). A compressed
    chunk into an idle engine is imported by its thread the moment it arrives, alongside the receive
    thread, which measured faster for large pulls than handing it to the landing thread."""
    kv = engine.kv
    local = local_prefix(kv, hashes)
    if local == len(hashes) or not (places or steps(engine)):
        return local, None
    return local, kv.reserve_landing(hashes[local - 1] if local else kv.root, hashes[local:])


def _plans_here_if_idle(engine) -> bool:
    """Whether a pull may reserve its blocks off the engine thread while the engine idles: a reservation may
    evict cached blocks, and with a cold tier each is spilled to disk read out through MLX
    (`KVCache._spill`), which makes arrays only the engine thread may make (`AsyncEngine.call_here_if_idle`)."""
    return engine.engine.kv.cold is None


def steps(engine) -> bool:
    """Whether `engine` (an `orchard.node.engine.LLMEngine`) is stepping: it has requests. Read from any
    thread: a pull lands compressed chunks off its thread while it steps (`_plan`), and has it list the
    blocks landed chunk by chunk (`_ChunkLander.placed`)."""
    return engine.has_unfinished


class _Sink:
    """What both sinks do once every stream's reply ends: have the engine run `finish` after every call they
    queued there, and publish the KV events of the pull, from the thread that saw the last end: there where
    the engine idles, else queued for the engine thread (`AsyncEngine.call_here_if_idle`); `finished` settles
    once it ran. A stream that ends short ends the others: its part's blocks are missing, and the blocks
    after them are not cached (`BlockLanding.landed`)."""

    def __init__(self, engine, result: PullResult, streams: Sequence[LinkStream]):
        self.engine, self.result, self.streams = engine, result, list(streams)
        self.error: Exception | None = None
        self.failure: BaseException | None = None  # what ended the first stream that ended short
        self.finished: Future = Future()
        self._ends = len(self.streams)  # streams whose end is still to come
        self._lock = threading.Lock()  # the receive threads' counts

    def received(self, size: int) -> None:  # a receive thread
        with self._lock:
            self.result.bytes += size

    def stream_ended(self, stream: LinkStream) -> None:  # its receive thread, once
        with self._lock:
            first_failure = stream.failure is not None and self.failure is None
            if first_failure:
                self.failure = stream.failure
            self._ends -= 1
            last = self._ends == 0
        if first_failure:
            self.stop()
        if last:
            self.end()

    def stop(self) -> None:
        """Nothing more of the pull is wanted: close every stream."""
        for stream in self.streams:
            stream.close()

    def end(self) -> None:  # the receive thread of the last stream to end
        self._run_finish()

    def finish(self, engine) -> None:  # the engine's turn, after every call the pull queued there
        return None

    def _run_finish(self) -> None:
        self.engine.call_here_if_idle(self.finish, self._settle_finish, publish=True)

    def _settle_finish(self, _result, exc: Exception | None) -> None:  # the engine's turn
        if exc is not None:
            self.finished.set_exception(exc)
        else:
            self.finished.set_result(None)


class _StreamSink:
    """One stream's chunks, told to its pull's sink with the stream they came on and the part of the landing
    they land in (`orchard.node.serving.kv_link.ChunkSink`)."""

    def __init__(self, sink: _Sink, stream: LinkStream, part: LandingPart | None):
        self.sink, self.stream, self.part = sink, stream, part

    def __call__(self, buffer: bytearray, size: int, payload: KVPayload) -> None:  # receive thread
        self.sink.chunk(self, buffer, size, payload)

    def placed(self, size: int) -> None:  # receive thread
        self.sink.placed(size)

    def end(self) -> None:  # receive thread, once
        self.sink.stream_ended(self.stream)


class _ChunkLander(_Sink):
    """Has a stepping engine list as cached the blocks of chunks the receive threads read straight into the
    blocks reserved for them (`orchard.kvcache.block_landing`) as each lands (`placed`), and the engine at the
    end (`finish`) the rest, with those of chunks a stream handed here from a buffer: those land in the
    stream's part on the path's landing thread, so the receive thread takes the next chunk meanwhile. The first
    refused chunk stops the rest and ends the streams."""

    def __init__(self, landing: BlockLanding, result: PullResult, lander: ThreadPoolExecutor, engine,
                 streams: Sequence[LinkStream]):
        super().__init__(engine, result, streams)
        self.landing, self._lander = landing, lander
        self._handed = False  # a chunk went to the landing thread

    def chunk(self, via: _StreamSink, buffer: bytearray, size: int, payload: KVPayload) -> None:  # receive thread
        self.received(size)
        self._handed = True
        self._lander.submit(self._land, via, buffer, payload)

    def placed(self, size: int) -> None:  # receive thread: a chunk read straight into its blocks
        """Have a stepping engine thread list the landed blocks now (`BlockLanding.adopt_landed`), between two
        steps, queued straight from here, so that `finish`, which waits for the step in progress, lists only
        the last chunk's. An idle engine lists them all in `finish`, which the last receive thread then runs
        itself (`_Sink.end`): listed here chunk by chunk instead, the listing slowed this thread, the pull's
        slowest stage, on 4 and 16 cores (docs/benchmarks.md, "## migration")."""
        self.received(size)
        if steps(self.engine.engine):
            self.engine.call_from_thread(lambda e: self.landing.adopt_landed(), self._listed)

    def end(self) -> None:  # the receive thread of the last stream to end
        """`finish` once every chunk handed to the landing thread has landed: asked for from that thread after them."""
        self._lander.submit(self._run_finish) if self._handed else self._run_finish()

    def _listed(self, listed: int | None, exc: Exception | None) -> None:  # the engine's turn
        if exc is not None and self.error is None:
            self.error = exc
            self.stop()
        self.result.imported += listed or 0

    def _land(self, via: _StreamSink, buffer: bytearray, payload: KVPayload) -> None:  # landing thread
        try:
            if self.error is None:
                via.part.land(payload.blocks)
        except Exception as exc:  # a chunk that is not the run's next blocks: nothing more is wanted
            self.error = exc
            self.stop()
        finally:
            via.stream.done(buffer)

    def finish(self, engine) -> None:  # the engine's turn, once the replies ended or broke off and every chunk landed
        self.result.imported += self.landing.adopt()


class _ChunkImporter(_Sink):
    """Imports each verified chunk on the engine thread, queued straight from the receive thread
    (`AsyncEngine.call_from_thread`), so no chunk waits for the event loop to wake; the first
    refused chunk stops the rest and ends the streams."""

    def chunk(self, via: _StreamSink, buffer: bytearray, size: int, payload: KVPayload) -> None:  # receive thread
        self.received(size)
        self.engine.call_from_thread(lambda e: self._import(e, payload), lambda n, exc: self._settle(via, buffer, n, exc))

    def _import(self, engine, payload: KVPayload) -> int:
        return 0 if self.error is not None else engine.kv.import_decoded(payload.blocks, payload.state)

    def _settle(self, via: _StreamSink, buffer: bytearray, imported: int | None, exc: Exception | None) -> None:  # engine thread
        if exc is not None and self.error is None:
            self.error = exc
            self.stop()  # nothing more of this reply is wanted
        self.result.imported += imported or 0
        via.stream.done(buffer)
