"""A gateway's direct connection to a node: its requests in, their outputs out, instead of Ray calls.

Why: through Ray a request's submission took 1.5-1.7 ms to reach the engine thread and each
output message 2.4-3.1 ms from the actor's yield to the gateway's reader on the 2-core VM, while
the engine thread built the next step (docs/benchmarks.md, "Requests and outputs over a direct link"):
Ray serializes, reports and fetches every call and item with Python work on both sides. Here
each is one pickle, one write and one read. Ray's `submit` and `outputs` stay for a gateway
that cannot connect (no key, no address); aborts and everything else stay Ray calls.

The connection opens with `node.serving.link_auth`'s handshake under its own magic and key,
so only a holder of the cluster's secret submits to a node or reads its outputs, and the
gateway knows it reached the node it meant. Then, on the wire (u32 length before each):

    gateway -> node   msgpack {"receiver": name}: the name its requests go under, once
                      then pickles of ("submit", request_id, prompt_token_ids, SamplingParams)
    node -> gateway   pickles of a list: what `Subscribers.outputs(name)` gathered (`RequestOutput`
                      deltas, `StreamFailed`, and `Accepted` / `Refused` answering a submission),
                      about one engine step's worth a message

Pickle is what Ray itself sends between these processes; it is only ever read from a peer
that proved the key. The gateway's end closing ends the stream, which aborts the receiver's
requests, as closing a Ray stream does. The gateway's end: `cluster.gateway.node_streams`.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack

from node.errors import EngineError
from node.serving import link_auth as auth
from node.serving.link_io import U32, Listener, read_frame, recv_exact, write_frame
from node.serving.output_streams import Subscribers
from node.types import SamplingParams

log = logging.getLogger(__name__)

MAGIC = b"ORGWLNK1"
KEY_PURPOSE = "gateway-link-v1"
_MAX_REQUEST = 4096


#: submit(receiver, request_id, prompt_token_ids, params): returns once the engine took it, raises what refused it
Submit = Callable[[str, str, list, SamplingParams], Awaitable[None]]


@dataclass(frozen=True)
class Accepted:
    """The engine took the submission `request_id`."""

    request_id: str


@dataclass(frozen=True)
class Refused:
    """The node refused the submission `request_id` with `error` (a named error of the engine's)."""

    request_id: str
    error: BaseException


def gateway_link_key(secret: str | None, environ=None) -> bytes | None:
    """The gateway link's key from `secret` or the environment's Ray token; None: no link."""
    return auth.link_key(secret, environ, KEY_PURPOSE)


class GatewayLinkServer(Listener):
    """Gateways' connections: accepted and authenticated on threads (the handshake blocks), then
    served from the actor's event loop, where the receivers' queues live."""

    def __init__(self, key: bytes, node_id: str, subscribers: Subscribers, submit: Submit,
                 loop: asyncio.AbstractEventLoop, host: str):
        super().__init__(host, 0, self._admit, "gateway-link")
        self.key, self.node_id, self.subscribers, self.submit, self.loop = key, node_id, subscribers, submit, loop
        self.refused = 0  # connections that did not prove the key
        self._starting: set[asyncio.Task] = set()  # submissions waiting for the engine, held until answered

    def _admit(self, conn: socket.socket) -> None:
        """Handshake and request on this thread, then hand the connection to the event loop."""
        try:
            if not auth.answer_handshake(conn, self.key, self.node_id, MAGIC):
                self.refused += 1
                conn.close()
                return
            receiver = _read_receiver(conn)
            conn.setblocking(False)
            asyncio.run_coroutine_threadsafe(self._stream(conn, receiver), self.loop)
        except (OSError, ValueError) as exc:
            log.info("gateway link %s: connection refused: %s", self.node_id, exc)
            conn.close()

    async def _stream(self, conn: socket.socket, receiver: str) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        requests = asyncio.get_running_loop().create_task(self._take_requests(reader, receiver, asyncio.current_task()))
        try:
            async for batch in self.subscribers.outputs(receiver):  # closing it aborts the receiver's requests
                write_frame(writer, batch)
                await writer.drain()
        except ConnectionError as exc:
            log.info("gateway link %s: receiver %s gone: %s", self.node_id, receiver, exc)
        except Exception:  # nobody awaits this task: say what ended it
            log.exception("gateway link %s: stream to receiver %s failed", self.node_id, receiver)
        finally:
            requests.cancel()
            writer.close()

    async def _take_requests(self, reader: asyncio.StreamReader, receiver: str, stream: asyncio.Task) -> None:
        """Start each submission as it arrives; the gateway's end closing (or a malformed request) ends
        the stream, and with it the receiver's requests."""
        try:
            while True:
                request_id, prompt, params = _submission(await read_frame(reader))
                task = asyncio.get_running_loop().create_task(self._start(receiver, request_id, prompt, params))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (ValueError, pickle.UnpicklingError) as exc:
            log.warning("gateway link %s: receiver %s sent a malformed request: %s", self.node_id, receiver, exc)
        stream.cancel()

    async def _start(self, receiver: str, request_id: str, prompt: list, params: SamplingParams) -> None:
        try:
            await self.submit(receiver, request_id, prompt, params)
        except Exception as exc:  # the engine's refusal goes back to the gateway, which raises it
            self.subscribers.send(receiver, Refused(request_id, _portable(exc)))
        else:
            self.subscribers.send(receiver, Accepted(request_id))


def _portable(error: Exception) -> Exception:
    """`error`, or an `EngineError` naming it when it would not come out of a pickle whole (its
    constructor taking other arguments than its message): one refusal must not break the link."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
        return error
    except Exception:
        return EngineError(f"{type(error).__name__}: {error}")


def _submission(request: object) -> tuple[str, list, SamplingParams]:
    if (not isinstance(request, tuple) or len(request) != 4 or request[0] != "submit" or not isinstance(request[1], str)
            or not isinstance(request[2], list) or not isinstance(request[3], SamplingParams)):
        raise ValueError("not a submission")
    return request[1], request[2], request[3]


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


def open_gateway_link(address: str, key: bytes, node_id: str, receiver: str) -> socket.socket:
    """A blocking socket to `node_id` for `receiver`'s requests and outputs (run it in a thread); raises
    OSError or `link_auth.LinkRefused` when no link can be made."""
    sock = auth.dial(address, key, node_id, MAGIC)
    try:
        body = msgpack.packb({"receiver": receiver})
        sock.sendall(U32.pack(len(body)) + body)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


async def read_messages(reader: asyncio.StreamReader):
    """The lists a node sends on a link (from `open_gateway_link`), until it closes (IncompleteReadError)."""
    while True:
        yield await read_frame(reader)
