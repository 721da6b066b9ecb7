"""A node's coalesced outputs to a gateway over a direct connection, instead of a Ray stream.

Why: through Ray's streaming generator (`NodeActor.outputs`) a message took 2.8 ms from the
actor's yield to the gateway's reader on the 2-core VM, while the engine thread built the
next step (docs/benchmarks.md, "Outputs over a direct link"): Ray serializes, reports and
fetches each item with Python work on both sides. Here a message is one pickle, one write
and one read. The Ray stream stays for a gateway that cannot connect (no key, no address).

The connection opens with `node.serving.link_auth`'s handshake under its own magic and key,
so only a holder of the cluster's secret reads a node's outputs, and the gateway knows it
reached the node it meant. Then, on the wire:

    request   u32 length, msgpack {"receiver": name}  (the name the gateway submits under)
    messages  u32 length, pickle of a list: what `Subscribers.outputs(name)` gathered
              (`RequestOutput` deltas, `StreamFailed`), about one engine step's worth

Pickle is what Ray itself sends between these processes; it is only ever read from a peer
that proved the key. The gateway writes nothing after its request: its end closing ends the
stream, which aborts the receiver's requests, as closing a Ray stream does.
The gateway's end: `cluster.gateway.node_streams`.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket

import msgpack

from node.serving import link_auth as auth
from node.serving.link_io import U32, Listener, recv_exact
from node.serving.output_streams import Subscribers

log = logging.getLogger(__name__)

MAGIC = b"ORSTRM01"
KEY_PURPOSE = "output-link-v1"
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
MAX_MESSAGE = 256 << 20  # a reader refuses a length past this: a broken stream, not a step's outputs
_MAX_REQUEST = 4096


def output_link_key(secret: str | None, environ=None) -> bytes | None:
    """The output link's key from `secret` or the environment's Ray token; None: no link."""
    return auth.link_key(secret, environ, KEY_PURPOSE)


class OutputLinkServer(Listener):
    """Gateways' connections: accepted and authenticated on threads (the handshake blocks), then
    streamed from the actor's event loop, where the receivers' queues live."""

    def __init__(self, key: bytes, node_id: str, subscribers: Subscribers, loop: asyncio.AbstractEventLoop, host: str):
        super().__init__(host, 0, self._admit, "output-link")
        self.key, self.node_id, self.subscribers, self.loop = key, node_id, subscribers, loop
        self.refused = 0  # connections that did not prove the key

    def _admit(self, conn: socket.socket) -> None:
        """Handshake and request on this thread, then hand the connection to the event loop."""
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not auth.answer_handshake(conn, self.key, self.node_id, MAGIC):
                self.refused += 1
                conn.close()
                return
            receiver = _read_receiver(conn)
            conn.setblocking(False)
            asyncio.run_coroutine_threadsafe(self._stream(conn, receiver), self.loop)
        except (OSError, ValueError) as exc:
            log.info("output link %s: connection refused: %s", self.node_id, exc)
            conn.close()

    async def _stream(self, conn: socket.socket, receiver: str) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        watch = asyncio.get_running_loop().create_task(_cancel_on_eof(reader, asyncio.current_task()))
        try:
            async for batch in self.subscribers.outputs(receiver):  # closing it aborts the receiver's requests
                body = pickle.dumps(batch, protocol=5)
                writer.write(U32.pack(len(body)) + body)
                await writer.drain()
        except ConnectionError as exc:
            log.info("output link %s: receiver %s gone: %s", self.node_id, receiver, exc)
        except Exception:  # nobody awaits this task: say what ended it
            log.exception("output link %s: stream to receiver %s failed", self.node_id, receiver)
        finally:
            watch.cancel()
            writer.close()


async def _cancel_on_eof(reader: asyncio.StreamReader, task: asyncio.Task) -> None:
    """The gateway sends nothing after its request: a read that ends means it left."""
    try:
        await reader.read(1)
    except ConnectionError:
        pass
    task.cancel()


def _read_receiver(conn: socket.socket) -> str:
    header = recv_exact(conn, 4)
    size = U32.unpack(header)[0] if header is not None else 0
    if not 0 < size <= _MAX_REQUEST:
        raise ValueError("no request, or one too long")
    body = recv_exact(conn, size)
    request = msgpack.unpackb(body, raw=False) if body is not None else None
    if not isinstance(request, dict) or not isinstance(request.get("receiver"), str):
        raise ValueError("malformed request")
    return request["receiver"]


def open_output_link(address: str, key: bytes, node_id: str, receiver: str) -> socket.socket:
    """A blocking socket reading `node_id`'s outputs for `receiver` (run it in a thread); raises
    OSError or `link_auth.LinkRefused` when no link can be made."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        auth.open_handshake(sock, key, node_id, address, MAGIC)
        body = msgpack.packb({"receiver": receiver})
        sock.sendall(U32.pack(len(body)) + body)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


async def read_messages(sock: socket.socket):
    """The lists a node sends on `sock` (from `open_output_link`), until it closes (IncompleteReadError)."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        while True:
            size = U32.unpack(await reader.readexactly(4))[0]
            if size > MAX_MESSAGE:
                raise ValueError(f"a message of {size} bytes")
            yield pickle.loads(await reader.readexactly(size))
    finally:
        writer.close()
