"""Bytes on an authenticated link's socket (`orchard.node.serving.kv_link`, `orchard.node.serving.gateway_link`):
the listener, framing, payloads, timeouts.

Once authenticated, a connection is in blocking mode with the kernel's send and receive
timeouts (`SO_SNDTIMEO`, `SO_RCVTIMEO`) rather than Python's: a slice of a chunk is then one
`recv_into(MSG_WAITALL)` and a batch of pieces one `sendmsg`, where a Python timeout (a
non-blocking socket polled) returns to Python, and asks for the GIL, every few KiB.

A payload goes out in batches of about `BATCH_BYTES`, each checksummed just before it is
sent, and comes in slices of `LANDING_BYTES`, each checksummed just after it landed
(`orchard.kvcache.wire_transit`): the checksum and the kernel's copy then read the same bytes once
from memory between them, the second read from the CPU's cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Coroutine

from orchard.kvcache.wire_transit import IncomingPayload, OutgoingPayload

U32, U64 = struct.Struct(">I"), struct.Struct(">Q")
MAX_PIECES = 512  # per sendmsg; IOV_MAX is 1024 on Linux and macOS
BATCH_BYTES = 512 << 10  # checksummed, then copied by the kernel, while still in a core's cache
LANDING_BYTES = 512 << 10
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
MAX_FRAME = 256 << 20  # a reader refuses a length past this: a broken stream, not a message


async def read_frame(reader: asyncio.StreamReader) -> object:
    """One pickled frame off an authenticated link (raises IncompleteReadError once the peer has closed)."""
    return await _frame_from(reader.readexactly)


def write_frame(writer: asyncio.StreamWriter, item: object) -> None:
    writer.write(frame(item))


def frame(item: object) -> bytes:
    body = pickle.dumps(item, protocol=5)
    return U32.pack(len(body)) + body


async def read_socket_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> object:
    """`read_frame` off a non-blocking socket owned by no transport (a `FrameSender`'s); raises
    IncompleteReadError once the peer has closed."""
    return await _frame_from(lambda n: _sock_read_exactly(loop, sock, n))


async def _frame_from(read_exactly) -> object:
    size = U32.unpack(await read_exactly(4))[0]
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    return pickle.loads(await read_exactly(size))


async def _sock_read_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        read = await loop.sock_recv_into(sock, view[got:])
        if read == 0:
            raise asyncio.IncompleteReadError(bytes(buffer[:got]), n)
        got += read
    return buffer


class FrameSender:
    """Frames onto a non-blocking socket from any thread, in order, never blocking the sender: what
    the kernel takes at once goes at once, the rest waits here and the event loop writes it when
    the socket can take more. An engine thread sends a step's outputs so without waking the loop.

    The socket must belong to no asyncio transport (read it with `read_socket_frame`)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self._sock, self._loop, self._lock = sock, loop, threading.Lock()
        self._backlog = bytearray()
        self.closed = False

    def send(self, item: object) -> bool:
        """Queue `item`'s frame; False once the connection is closed or broken (nothing more goes)."""
        data = frame(item)
        with self._lock:
            if self.closed:
                return False
            if self._backlog:
                self._backlog += data
                return True
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.closed = True
                return False
            if sent < len(data):
                self._backlog += memoryview(data)[sent:]
                self._loop.call_soon_threadsafe(self._watch)
            return True

    def close(self) -> None:
        """Send nothing more (on the loop's thread: it stops watching the socket)."""
        with self._lock:
            self.closed = True
            self._backlog.clear()
        self._loop.remove_writer(self._sock.fileno())

    def _watch(self) -> None:
        if not self.closed:
            self._loop.add_writer(self._sock.fileno(), self._flush)

    def _flush(self) -> None:
        with self._lock:
            sent = 0
            try:
                sent = 0 if self.closed else self._sock.send(self._backlog)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
            del self._backlog[:sent]
            if self._backlog and not self.closed:
                return
        self._loop.remove_writer(self._sock.fileno())


class Listener:
    """A listening socket whose every connection gets a thread of its own running `serve(conn)`
    (handshakes and KV replies block; the event loop never waits on a peer)."""

    def __init__(self, host: str, port: int, serve: Callable[[socket.socket], None], name: str):
        self.host, self.port, self.serve, self.name = host, port, serve, name
        self._sock: socket.socket | None = None
        self._on_loop: set[concurrent.futures.Future] = set()  # connections served on an event loop, until they end

    @property
    def address(self) -> str | None:
        if self._sock is None:
            return None
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        self._sock = socket.create_server((self.host, self.port))
        threading.Thread(target=self._accept_loop, args=(self._sock,), name=f"{self.name}-accept", daemon=True).start()
        return self.address

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def serve_on(self, loop: asyncio.AbstractEventLoop, serving: Coroutine) -> None:
        """Run a connection's `serving` on `loop`, held here until it ends. asyncio keeps only weak
        references to tasks, and a task waiting on a stream made by `asyncio.open_connection` is reachable
        from nothing but itself: unheld, a garbage collection ends the connection mid-way."""
        future = asyncio.run_coroutine_threadsafe(serving, loop)
        self._on_loop.add(future)
        future.add_done_callback(self._on_loop.discard)

    def _accept_loop(self, sock: socket.socket) -> None:
        while self._sock is sock:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self.serve, args=(conn,), name=f"{self.name}-conn", daemon=True).start()


def send_payload(sock: socket.socket, pieces: list) -> int:
    """Send one payload (`orchard.kvcache.wire_stream.payload_pieces`: all but its checksum) after its u64
    length, checksumming it batch by batch as it goes and sending the checksum last; its size."""
    outgoing = OutgoingPayload(pieces)
    head = [U64.pack(outgoing.size)]
    for batch in outgoing.batches(BATCH_BYTES, MAX_PIECES - 1):
        send_pieces(sock, head + batch)
        head = []
    send_pieces(sock, [*head, outgoing.checksum()])
    return outgoing.size


def receive_payload(sock: socket.socket, buffer, incoming: IncomingPayload | None = None) -> IncomingPayload | None:
    """Fill `buffer` (exactly one payload's size) slice by slice, each checksummed as it lands (or the
    rest of `incoming`'s, where its first bytes landed already); None when the peer closed first.
    `decode` the answer: it refuses a checksum that differs."""
    incoming = incoming or IncomingPayload(buffer)
    size = len(incoming.data)
    for start in range(incoming.landed_bytes, size, LANDING_BYTES):
        end = min(size, start + LANDING_BYTES)
        if not recv_into(sock, incoming.data[start:end]):
            return None
        incoming.landed(end)
    return incoming


def data_mode(sock: socket.socket, timeout_s: float) -> None:
    """Blocking, with the kernel's timeouts: a whole slice is one system call (module docstring)."""
    sock.settimeout(None)
    seconds = max(1, int(timeout_s))
    timeval = struct.pack("ll", seconds, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def grow_send_buffer(sock: socket.socket, nbytes: int | None) -> None:
    """Ask for a send buffer of `nbytes`, halving where the kernel refuses (macOS refuses sizes
    past its limit where Linux caps them); never below what the kernel already gave."""
    while nbytes and nbytes > sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
            return
        except OSError:
            nbytes //= 2


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buffer = bytearray(n)
    return bytes(buffer) if recv_into(sock, memoryview(buffer)) else None


def recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False when the peer closed first."""
    return recv_pieces(sock, [view])


def recv_pieces(sock: socket.socket, views: list[memoryview]) -> bool:
    """Fill every view in order from `sock` with scatter reads (`recvmsg_into`): pieces that lie apart in
    memory (a layer's rows in the pool, the headers between them) in one system call; False when the
    peer closed first."""
    pending, i = [view for view in views if len(view)], 0
    flags = _WAITALL if sock.gettimeout() is None else 0
    while i < len(pending):
        try:
            got = sock.recvmsg_into(pending[i : i + MAX_PIECES], 0, flags)[0]
        except BlockingIOError as exc:  # the kernel's receive timeout (`data_mode`)
            raise TimeoutError("the KV link's peer sent nothing within its timeout") from exc
        if got == 0:
            return False
        while got and got >= len(pending[i]):  # drop what is full; keep the rest of a part-filled view
            got -= len(pending[i])
            i += 1
        if got:
            pending[i] = pending[i][got:]
    return True


def send_pieces(sock: socket.socket, pieces: list) -> None:
    """Send every piece (`bytes` or a memoryview of bytes: its `len` is its size) in order with
    scatter-gather writes: no byte is copied in user space, and a batch the kernel took whole
    costs no Python per piece."""
    pending = list(pieces)
    i = 0
    while i < len(pending):
        batch = pending[i : i + MAX_PIECES]
        try:
            sent = sock.sendmsg(batch)
        except BlockingIOError as exc:  # the kernel's send timeout (`data_mode`)
            raise TimeoutError("the KV link's peer took nothing within its timeout") from exc
        if sent == sum(map(len, batch)):
            i += len(batch)
            continue
        for piece in batch:  # drop what went out; keep the rest of a partly sent piece
            if sent >= len(piece):
                sent -= len(piece)
                i += 1
            else:
                pending[i] = memoryview(piece)[sent:]
                break


def eof():
    raise ConnectionError("the KV link closed mid-reply")
