"""The direct KV data path between two nodes: a listener on each, a client in each pull.

Ray's object store moves a payload at a fifth of what the link carries, and needs the
payload as one bytes object on both sides; this link sends a pull's blocks over a TCP
connection (or a part of them over each of several: `KVLinkConfig.connections_per_pull`), straight
from the pool's arrays, into the pool blocks reserved for them or buffers the target keeps for the
next pull. On the wire (after `orchard.node.serving.link_auth`'s handshake):

    request   u32 length, msgpack {"hashes": [bytes, ...], "chunk_bytes": int[, "layer_major": true][, "compress": "zstd"]}
              or {"probe": nbytes}: a well-formed payload of blocks no model uses (`orchard.node.serving.migration.probe_payload`)
    reply     per chunk: u64 length, then one `orchard.kvcache.wire` payload (checksummed); u64 0 ends it
              (a hybrid model's run is one chunk: its blocks are worth importing only with the
              recurrent state after the last of them, which travels in the same payload)

A target that reads wire format version 3 (`orchard.kvcache.wire_layers`, a chunk laid out layer by
layer) says so with "layer_major"; a source that can lay its run out so answers in version 3, any
other in version 2 (a source that knows no such key ignores it), and the target reads either.
A target on a slow link asks with "compress" for each chunk as an `orchard.kvcache.wire_compressed`
frame; a source that knows no such key sends plain payloads, which the target reads as well.

Each chunk is a whole payload, so the target verifies chunk i and writes it into its pool
(`orchard.node.serving.direct_path`) while chunk i+1 arrives, or reads it straight into the pool
blocks reserved for it (`LinkStream`'s landing), and the source lays out chunk i+1 while the kernel
still sends what it took of chunk i from the socket's buffer: the slowest stage sets the rate.
A source that holds fewer blocks than asked sends fewer.

Threads with blocking sockets, not asyncio streams: Python 3.11's transports join the
buffers of `writelines` into one (a copy of every byte), and a thread's `sendmsg` and
`recv_into` release the GIL, so the actor's event loop stays free to serve while bytes move.
How bytes move on a connection (the kernel's timeouts, a chunk checksummed slice by slice as
it is sent and as it lands): `orchard.node.serving.link_io`. The receive thread also verifies each
chunk: the kernel's receive buffer keeps filling meanwhile, and a second thread would only
add a GIL hand-off per chunk. It starts reading once the target knows where the chunks go (`take`),
woken by the thread that says so: woken by the first bytes instead, it was put by Linux on the
sender's core where both ends share a machine, to wait there behind the sender while another core
idled (docs/benchmarks.md, "## migration").
Anything that fails before the reply starts (no address, refused, wrong node) means "no
direct path": the caller falls back to Ray. Nothing listens unless a key is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import msgpack

from orchard.kvcache import wire_compressed
from orchard.kvcache.block_landing import BlockLanding
from orchard.kvcache.errors import KVCacheError
from orchard.kvcache.hashing import BlockHash
from orchard.kvcache.wire import KVPayload, StateSnapshotData
from orchard.kvcache.wire_batch import record_layout
from orchard.kvcache.wire_layers import layer_pieces, layout_of_size
from orchard.kvcache.wire_stream import payload_pieces
from orchard.kvcache.wire_transit import IncomingPayload
from orchard.node.serving import link_auth as auth
from orchard.node.serving import link_io
from orchard.node.serving.link_io import U32, U64, data_mode, eof, grow_send_buffer, recv_exact
from orchard.node.serving.link_threads import KeptThreads, run_on_new_thread
from orchard.node.serving.migration import probe_payload

log = logging.getLogger(__name__)

_MAX_REQUEST = 64 << 20
COMPRESS_MODES = ("auto", "always", "never")
RATE_MIN_BYTES = 1 << 20  # a reply shorter than this says too little of its link's rate
SENDERS = KeptThreads("kv-link-send")  # each reply's sending, where it does not go from the connection's thread
RECEIVERS = KeptThreads("kv-link-recv")  # each pull's receive loop, where it does not get a thread started for it
#: A process that may run on this many cores or fewer sends each reply from a kept thread, receives each pull on
#: a thread started for it, and pulls over one connection at a time (`KVLinkConfig`).
FEW_CORES = 2
MANY_CORES_CONNECTIONS = 2  # a pull's connections where the process has more cores (`KVLinkConfig.connections_per_pull`)


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the OS tells it (Linux), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity to ask
        return os.cpu_count() or 1


def few_cores() -> bool:
    """Whether this process may run on `FEW_CORES` cores or fewer: what the link's defaults that depend on cores
    follow (`KVLinkConfig.replies_from_kept_threads`, `receives_on_kept_threads`, `pull_connections`)."""
    return usable_cores() <= FEW_CORES


@dataclass(frozen=True)
class KVLinkConfig:
    host: str = "127.0.0.1"  # the address to listen on; beyond loopback only when the cluster binds there
    port: int = 0
    chunk_bytes: int = 4 << 20  # the largest chunk a pull asks for (`orchard.node.serving.direct_path.chunk_size`)
    handshake_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    # The sender's socket buffer (the kernel caps it: net.core.wmem_max on Linux, kern.ipc.maxsockbuf
    # on macOS): two chunks queued in the kernel keep the link busy while the next is encoded. The
    # receive side is left to the kernel's autotuning, which setting SO_RCVBUF would switch off.
    send_buffer_bytes: int | None = 8 << 20
    # Pulls ask for compressed chunks (`orchard.kvcache.wire_compressed`): "always", "never", or "auto":
    # where the link from that source carried fewer than `compress_below_bytes_per_s` in the last pull long
    # enough to tell (`LinkStream.link_rate`): a link slower than the compressor, such as 1 Gbit/s Ethernet
    # or Wi-Fi (docs/benchmarks.md, "## migration").
    compress: str = "auto"
    compress_below_bytes_per_s: float = 250e6
    # Each reply sent from a thread kept for replies (`SENDERS`) rather than from its connection's: True,
    # False, or None for where this process may run on `FEW_CORES` cores or fewer (`usable_cores`). A socket
    # wakes its reader as a "sync" wake-up, which Linux answers by putting the reader beside the thread that
    # sent: where both ends of a pull share a machine of two cores, a reply sent from the connection's thread
    # held the core the target's threads needed. With more cores the hand-over to another thread is one more
    # wake-up before the first chunk, for nothing (measured at two cores and at sixteen: docs/benchmarks.md,
    # "## migration").
    reply_from_kept_thread: bool | None = None
    # A plain pull of more than one chunk asks for its run in consecutive parts of whole chunks, each over a
    # connection of its own, at once: each end then has a thread a connection that copies and checksums its
    # part's bytes, where one thread did all of them. None: `MANY_CORES_CONNECTIONS` where this process may
    # run on more than `FEW_CORES` cores, else one (docs/benchmarks.md, "## migration").
    connections_per_pull: int | None = None
    # Each pull's receive loop run by a thread kept idle between pulls (`RECEIVERS`) rather than one started for it:
    # True, False, or None for where this process may run on more than `FEW_CORES` cores. `Thread.start` returns
    # once the new thread runs, two wake-ups before the next connection's request goes; on sixteen cores a pull
    # over two connections returned sooner with kept threads, and on two cores a pull over one returned later
    # (docs/benchmarks.md, "## migration").
    receive_on_kept_thread: bool | None = None

    def __post_init__(self):
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"compress is one of {COMPRESS_MODES}, not {self.compress!r}")
        if self.connections_per_pull is not None and self.connections_per_pull < 1:
            raise ValueError(f"connections_per_pull is at least 1, not {self.connections_per_pull}")

    def replies_from_kept_threads(self) -> bool:
        """Whether a listener sends each reply from a kept thread (`reply_from_kept_thread`, None resolved here)."""
        return few_cores() if self.reply_from_kept_thread is None else self.reply_from_kept_thread

    def receives_on_kept_threads(self) -> bool:
        """Whether a pull's receive loops run on kept threads (`receive_on_kept_thread`, None resolved here)."""
        return not few_cores() if self.receive_on_kept_thread is None else self.receive_on_kept_thread

    def pull_connections(self) -> int:
        """The connections a pull may spread its run over (`connections_per_pull`, None resolved here)."""
        if self.connections_per_pull is not None:
            return self.connections_per_pull
        return 1 if few_cores() else MANY_CORES_CONNECTIONS


@dataclass
class LinkCounters:
    accepted: int = 0  # connections that proved the key
    refused: int = 0  # connections that did not
    sent_bytes: int = 0


class ChunkSink(Protocol):
    """Where a pull's chunks go, told on the receive thread."""

    def __call__(self, buffer: bytearray, size: int, payload: KVPayload) -> None:
        """A verified chunk in `buffer` (views into it in `payload`); give the buffer back with `LinkStream.done`."""

    def placed(self, size: int) -> None:
        """A chunk of `size` bytes read straight into the stream's landing (only a stream given one calls it)."""

    def end(self) -> None:
        """Nothing more comes: the reply ended, broke off or was given up (once, before the caller learns it)."""


#: The source's side of a pull, blocking the link's thread while its engine thread runs it:
#: pin and describe the run (its blocks and, for a hybrid model, the state after them).
Exporter = Callable[[list[BlockHash]], tuple[object, list, StateSnapshotData | None]]
#: Let a pinned run go once sent: queued on the engine thread, which later calls run after (not waited for).
Releaser = Callable[[object], None]
#: The same for the layer-major format: the pinned handle and an `orchard.kvcache.block_transfer.LayerRun`,
#: or None where the run cannot be laid out so (the reply then goes in version 2).
LayerExporter = Callable[[list[BlockHash]], tuple[object, object] | None]


class KVLinkServer(link_io.Listener):
    """Accepts authenticated connections and streams the blocks they ask for."""

    def __init__(self, key: bytes, node_id: str, geometry, export: Exporter, release: Releaser,
                 config: KVLinkConfig | None = None, export_layers: LayerExporter | None = None):
        self.config = config or KVLinkConfig()
        super().__init__(self.config.host, self.config.port, self._serve, "kv-link")
        self.key, self.node_id, self.geometry = key, node_id, geometry
        self._export, self._release, self._export_layers = export, release, export_layers
        self.counters = LinkCounters()
        self.replies_from_kept_threads = self.config.replies_from_kept_threads()
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="kv-link-encode")  # probes, made ahead
        self._probes: dict[int, bytes] = {}

    def close(self) -> None:
        super().close()
        self._encoder.shutdown(wait=False)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not self._handshake(conn):
                    self.counters.refused += 1
                    return
                self.counters.accepted += 1
                data_mode(conn, self.config.io_timeout_s)
                grow_send_buffer(conn, self.config.send_buffer_bytes)
                while (request := _read_request(conn)) is not None:
                    self._answer(conn, request)
            except (OSError, ValueError) as exc:
                log.info("KV link %s: connection ended: %s", self.node_id, exc)

    def _answer(self, conn: socket.socket, request: dict) -> None:
        """`_reply` on this, the connection's, thread, or where `replies_from_kept_threads` on a kept thread
        (`SENDERS`, woken through a queue), this one waiting; what it raises is raised here either way
        (`KVLinkConfig.reply_from_kept_thread` says why both)."""
        if self.replies_from_kept_threads:
            SENDERS.run(lambda: self._reply(conn, request)).result()
        else:
            self._reply(conn, request)

    def _handshake(self, conn: socket.socket) -> bool:
        return auth.answer_handshake(conn, self.key, self.node_id, timeout_s=self.config.handshake_timeout_s)

    def _reply(self, conn: socket.socket, request: dict) -> None:
        if "probe" in request:
            payload = self._probe(min(int(request["probe"]), 64 << 20))
            conn.sendall(U64.pack(len(payload)) + payload + U64.pack(0))
            return
        hashes = [BlockHash(bytes(h)) for h in request["hashes"]]
        per_chunk = max(1, int(request.get("chunk_bytes", self.config.chunk_bytes)) // self.geometry.bytes_per_block)
        layered = self._export_layers(hashes) if request.get("layer_major") and self._export_layers else None
        if layered is not None:
            handle, run = layered
            chunks = (layer_pieces(self.geometry, run.chunk(start, min(len(run), start + per_chunk)))
                      for start in range(0, len(run), per_chunk))
        else:
            handle, blocks, state = self._export(hashes)
            chunks = (payload_pieces(self.geometry, *run) for run in reply_runs(blocks, state, per_chunk))
        if request.get("compress") == "zstd":
            chunks = (wire_compressed.compressed_pieces(pieces, self.geometry.itemsize) for pieces in chunks)
        self._send_chunks(conn, handle, chunks)

    def _send_chunks(self, conn: socket.socket, handle, chunks) -> None:
        """Send each chunk's payload, then the end marker; release the pinned run whatever happens, before the
        end marker goes (the kernel holds a copy of each byte it took), so that whatever the target asks of this
        node once its pull ended comes after the release. `chunks` is lazy: the next chunk's pieces are made
        while the kernel still sends what it took of the last."""
        try:
            for pieces in chunks:
                self.counters.sent_bytes += link_io.send_payload(conn, pieces)
        finally:
            self._release(handle)
        conn.sendall(U64.pack(0))

    def prepare_probes(self, sizes) -> None:
        """Encode probe payloads ahead (in the background), so a probe times the link, not the encoder."""
        for nbytes in sizes:
            self._encoder.submit(self._probe, nbytes)

    def _probe(self, nbytes: int) -> bytes:
        if nbytes not in self._probes:
            self._probes[nbytes] = probe_payload(self.geometry, nbytes)
        return self._probes[nbytes]


def reply_runs(blocks: list, state: StateSnapshotData | None, per_chunk: int) -> list[tuple[list, StateSnapshotData | None]]:
    """The reply's chunks as (blocks, state): `per_chunk` blocks each, or for a hybrid model the
    whole run with its state, since a chunk without the state after it could not be imported."""
    if state is not None:
        return [(blocks, state)]
    return [(blocks[i : i + per_chunk], None) for i in range(0, len(blocks), per_chunk)]


# ---- the client -----------------------------------------------------------------------


class LinkStream:
    """One pull's connection: chunks arrive on a thread into reused buffers, the caller awaits them."""

    def __init__(self, sock: socket.socket, buffers: list[bytearray], geometry, state_geometry=None,
                 kept_thread: bool = False):
        """`state_geometry`: a hybrid model's state pool geometry, which each chunk's state must have. The
        stream takes no chunk until `take` says where they go. `kept_thread`: its receive loop runs on one of
        `RECEIVERS`, else on a thread started for it (`KVLinkConfig.receive_on_kept_thread`)."""
        self.sock, self.geometry, self.state_geometry = sock, geometry, state_geometry
        self._sink: ChunkSink | None = None
        self._landing: BlockLanding | None = None
        self._taken = threading.Event()  # the sink and landing are known: the receive thread may take chunks
        self._closed = False
        self._told_end = False
        self._finished = False  # the receive thread has stopped: it writes no more blocks
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # the receive thread blocks on it
        self._ready: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        for buffer in buffers:
            self._free.put(buffer)
        self.buffers = buffers
        self.ended = False  # the reply's end marker arrived: the connection can serve another pull
        self.asked_blocks = 0  # the blocks the request asked for (`start`)
        self.wire_bytes = 0  # the chunks' bytes as they came over the link (fewer than their payloads' if compressed)
        self._began = self._ended = 0.0  # when the first chunk's bytes began to land, when the last chunk's had
        self.stalled_s = 0.0  # while the receive thread waited for a buffer: the target, not the link, set the pace
        self._inflate_limit = 0
        self._kept_thread = kept_thread
        self._receiving: concurrent.futures.Future | None = None  # settles once the receive loop returned
        self.failure: BaseException | None = None  # what ended the reply short, once it ended (`ChunkSink.end`)

    def start(self, hashes: Sequence[bytes], chunk_bytes: int, probe_bytes: int = 0, compress: bool = False) -> None:
        """Ask for the blocks of `hashes` (or, with `probe_bytes`, a probe payload of about that size);
        layer-major unless a hybrid model's, which needs the state that only version 2 carries; with
        `compress`, each chunk as a compressed frame, which inflates to no more than all it asked for."""
        self.asked_blocks = 0 if probe_bytes else len(hashes)
        ask = {"probe": probe_bytes} if probe_bytes else {"hashes": [bytes(h) for h in hashes], "chunk_bytes": chunk_bytes}
        if not probe_bytes and self.state_geometry is None:
            ask["layer_major"] = True
        if compress and not probe_bytes:
            ask["compress"] = "zstd"
            self._inflate_limit = asked_bytes(self.geometry, self.state_geometry, len(hashes))
        request = msgpack.packb(ask, use_bin_type=True)
        self.sock.sendall(U32.pack(len(request)) + request)
        self._receiving = (RECEIVERS.run(self._receive) if self._kept_thread
                           else run_on_new_thread(RECEIVERS.name, self._receive))

    async def chunks(self):
        """Yields (buffer, size, payload) until the reply ends, the payload verified and decoded as
        views into `buffer`; give the buffer back with `done` once it is imported. A stream given a
        sink hands each chunk to it instead and tells it the end (`ChunkSink.end`), not this: its
        `failure` then says how the reply ended."""
        while True:
            item = await self._ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def link_rate(self, min_bytes: int = RATE_MIN_BYTES) -> float | None:
        """Bytes/s the link carried from the first chunk's first bytes being read (as they land, but where
        they came before `take`) to the last chunk's last, less the time the receive thread waited for a
        buffer the target had not given back (chunks waiting for a busy engine thread or landing thread:
        the target's pace, not the link's), once the reply
        ended and carried at least `min_bytes`: the link's pace, without the fixed costs before and after
        that make a short pull slow on any link; else None."""
        moving = self._ended - self._began - self.stalled_s
        if not self.ended or self.wire_bytes < min_bytes or moving <= 0:
            return None
        return self.wire_bytes / moving

    def take(self, sink: ChunkSink | None, landing: BlockLanding | None = None) -> None:
        """Where the chunks go; once, before or after `start` (after it, the request goes while the caller
        still reserves the blocks, and the receive thread waits for this before it reads the reply). `sink`:
        None to await the chunks from `chunks`. `landing`: blocks reserved for the reply, which its version 3
        chunks are read straight into (`IncomingPayload.place`; the sink is called with the chunks that
        could not be, and its `placed(size)` after each of the others); the landing must take the wire's
        bytes as they are (`places_wire_bytes`)."""
        self._sink, self._landing = sink, landing
        self._taken.set()

    def done(self, buffer: bytearray) -> None:
        self._free.put(buffer)

    def close(self) -> None:
        """End the pull and the connection; wakes a receiver waiting for a buffer or for `take`."""
        self._closed = True
        self._taken.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._free.put(None)

    async def stopped(self) -> None:
        """Once the receive thread writes nothing more: at once where it has ended, else once it has, the
        connection closed first so it stops reading (a pull given up part way, its landing to be freed)."""
        if self._receiving is None or self._finished:
            return
        self.close()
        await asyncio.wrap_future(self._receiving)

    def release(self) -> socket.socket | None:
        """The connection, for the next pull, once the reply ended whole; else close it and None."""
        if not self.ended:
            self.close()
            return None
        if self._receiving is not None:
            concurrent.futures.wait([self._receiving], 1.0)  # past the end marker: the loop is returning
        return self.sock

    def _receive(self) -> None:
        """Socket to buffers, or straight into the landing's blocks, each chunk verified here before it is
        handed over (decoded) or counts as placed."""
        try:
            self._taken.wait()  # woken by this node's thread that gave the sink, not by the bytes (`take`)
            while (size := U64.unpack(recv_exact(self.sock, 8) or eof())[0]) != 0:
                self._began = self._began or time.perf_counter()
                buffer = self._next_buffer()
                if buffer is None:
                    raise ConnectionError("the pull was given up (its stream closed)")
                if len(buffer) < size:  # a new one (views of the old may live on), kept across pulls
                    self.buffers[self.buffers.index(buffer)] = buffer = bytearray(size)
                incoming = self._receive_chunk(memoryview(buffer)[:size])
                self.wire_bytes += size
                self._ended = time.perf_counter()
                if incoming is None:  # placed in the landing's blocks
                    self.done(buffer)
                    self._sink.placed(size)
                    continue
                payload = incoming.decode(self.geometry, self.state_geometry, self._inflate_limit)
                chunk = (buffer, incoming.payload_size, payload)
                self._sink(*chunk) if self._sink is not None else self._put(chunk)
            self.ended = True
            self._finish(None)
        except KVCacheError as exc:  # a refused payload is raised to the caller as is
            self._finish(exc)
        except Exception as exc:  # noqa: BLE001 - whatever stops the thread must reach the caller
            self._finish(exc if isinstance(exc, OSError) else ConnectionError(f"{type(exc).__name__}: {exc}"))

    def _receive_chunk(self, view: memoryview) -> IncomingPayload | None:
        """One chunk of `len(view)` bytes: straight into the landing's blocks where it is a version 3
        payload of the blocks it waits for (then None), else into `view`, checksummed as it lands."""
        layout = layout_of_size(self.geometry, len(view)) if self._landing is not None else None
        if layout is None:
            return link_io.receive_payload(self.sock, view) or eof()
        incoming = IncomingPayload(view)
        if not link_io.recv_into(self.sock, view[: layout.meta_size]):
            eof()
        incoming.landed(layout.meta_size)
        if incoming.place(layout, self._landing, lambda pieces: link_io.recv_pieces(self.sock, pieces) or eof()):
            return None
        return link_io.receive_payload(self.sock, view, incoming) or eof()

    def _finish(self, last) -> None:
        """The reply ended (`last`: None) or broke off (`last`: why). A sink is told (`ChunkSink.end`), and
        nothing wakes the event loop: its caller waits for what the sink does at the end, a wake of its own."""
        self._taken.wait()  # a reply can end before its sink is known (a source that holds none of the run)
        self._finished = True
        self.failure = last
        if self._sink is not None:
            self._tell_end()
        else:
            self._put(last)

    def _tell_end(self) -> None:
        if not self._told_end:
            self._told_end = True
            self._sink.end()

    def _next_buffer(self) -> bytearray | None:
        if self._closed:
            return None
        try:
            return self._free.get_nowait()
        except queue.Empty:
            waited = time.perf_counter()
            buffer = self._free.get()
            self.stalled_s += time.perf_counter() - waited
            return buffer

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._ready.put_nowait, item)
        except RuntimeError:  # the loop is gone
            pass


def asked_bytes(geometry, state_geometry, num_blocks: int) -> int:
    """The most payload bytes a reply to a pull of `num_blocks` can carry: each block as a full block's
    record of wire format version 2 (the larger of the two layouts), a hybrid model's state, and room
    for the envelopes."""
    state = state_geometry.nbytes if state_geometry is not None else 0
    return num_blocks * record_layout(geometry).size + state + (1 << 20)


def connect(address: str, key: bytes, expected_node: str, config: KVLinkConfig) -> socket.socket:
    """An authenticated connection to `expected_node`'s listener (blocking: run it in a thread)."""
    sock = auth.dial(address, key, expected_node, auth.MAGIC, config.connect_timeout_s, config.handshake_timeout_s)
    try:
        data_mode(sock, config.io_timeout_s)
        return sock
    except BaseException:
        sock.close()
        raise


def _read_request(conn: socket.socket) -> dict | None:
    header = recv_exact(conn, 4)
    if header is None:
        return None
    size = U32.unpack(header)[0]
    if size > _MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    body = recv_exact(conn, size)
    request = msgpack.unpackb(body or b"", raw=False) if body is not None else None
    if not isinstance(request, dict) or not (isinstance(request.get("hashes"), list) or isinstance(request.get("probe"), int)):
        raise ValueError("malformed request")
    return request
