"""A gateway's direct connection to a node: its requests in, their outputs out, instead of Ray calls.

Why: through Ray a request's submission took 1.5-1.7 ms to reach the engine thread and each
output message 2.4-3.1 ms from the actor's yield to the gateway's reader on the 2-core VM, while
the engine thread built the next step (docs/benchmarks.md, "Requests and outputs over a direct link"):
Ray serializes, reports and fetches every call and item with Python work on both sides. Here
each is one pickle, one write and one read. Ray's `submit` and `outputs` stay for a gateway
that cannot connect (no key, no address); aborts and everything else stay Ray calls.

The engine thread writes the answers and each step's outputs itself (a `ReceiverSink`, the
engine's `OutputSink` for one connection's requests, through a `FrameSender`): the first token
reaches the gateway 0.41-0.52 ms after its step, against 0.77 ms through the actor's event loop,
and an `Accepted` 0.4-0.6 ms after the engine took the request, against 2.7 ms (docs/benchmarks.md,
"Outputs sent by the engine thread"). Submissions are read on the event loop.

The connection opens with `orchard.node.serving.link_auth`'s handshake under its own magic and key,
so only a holder of the cluster's secret submits to a node or reads its outputs, and the
gateway knows it reached the node it meant. Then, on the wire (u32 length before each):

    gateway -> node   msgpack {"receiver": name}: the gateway reader's name (the node's logs say it), once
                      then pickles of ("submit", request_id, prompt_token_ids, SamplingParams)
    node -> gateway   pickles of a list: `Accepted` / `Refused` answering a submission, or one engine
                      step's outputs of the connection's requests (`RequestOutput` deltas), or a
                      `StreamFailed` for a request whose step raised

Pickle is what Ray itself sends between these processes; it is only ever read from a peer
that proved the key. The gateway's end closing ends the stream, which aborts the receiver's
requests, as closing a Ray stream does. The gateway's end: `orchard.cluster.gateway.node_streams`.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from orchard.node.errors import EngineError
from orchard.node.serving import link_auth as auth
from orchard.node.serving.link_io import U32, FrameSender, Listener, read_frame, read_socket_frame, recv_exact
from orchard.node.serving.output_streams import StreamFailed
from orchard.node.serving.stream_delta import only_new
from orchard.node.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

MAGIC = b"ORGWLNK1"
KEY_PURPOSE = "gateway-link-v1"
_MAX_REQUEST = 4096


#: start(request_id, prompt_token_ids, params, sink): hand the request to the engine (node.async_engine.AsyncEngine.start)
Start = Callable[[str, list, SamplingParams, "ReceiverSink"], None]
#: progress(started, finished): on the event loop, the requests whose first output (or refusal) went
#: out, and whether any ended: the node's heartbeat load follows them
Progress = Callable[[list[str], bool], None]


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


class ReceiverSink:
    """One connection's requests as the engine thread's `OutputSink`: each answer and each step's
    outputs of all of them go out as one frame, written by the engine thread (deltas only)."""

    def __init__(self, sender: FrameSender, loop: asyncio.AbstractEventLoop, progress: Progress):
        self.sender, self.loop, self.progress = sender, loop, progress
        self._lock = threading.Lock()
        self._live: set[str] = set()  # submitted and not ended: aborted when the connection goes
        self._started: set[str] = set()  # engine thread only: requests that sent their first output

    def submitted(self, request_id: str) -> None:
        with self._lock:
            self._live.add(request_id)

    def live(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def accepted(self, request_id: str) -> None:
        self.sender.send([Accepted(request_id)])

    def refused(self, request_id: str, error: Exception) -> None:
        self.sender.send([Refused(request_id, _portable(error))])
        self._ended([request_id], [request_id])

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self.sender.send([only_new(out) for out in outputs])
        first = [out.request_id for out in outputs if out.request_id not in self._started]
        self._started.update(first)
        self._ended(first, [out.request_id for out in outputs if out.finished])

    def failed(self, request_id: str, error: Exception) -> None:
        self.sender.send([StreamFailed(request_id, repr(error))])
        self._ended([request_id] if request_id not in self._started else [], [request_id])

    def _ended(self, first: list[str], ended: list[str]) -> None:
        if ended:
            with self._lock:
                self._live.difference_update(ended)
            self._started.difference_update(ended)
        if first or ended:
            self.loop.call_soon_threadsafe(self.progress, first, bool(ended))


class GatewayLinkServer(Listener):
    """Gateways' connections: accepted and authenticated on threads (the handshake blocks), then
    their submissions read on the actor's event loop and handed to the engine with the
    connection's `ReceiverSink`."""

    def __init__(self, key: bytes, node_id: str, start: Start, abort: Callable[[str], None], progress: Progress,
                 loop: asyncio.AbstractEventLoop, host: str):
        super().__init__(host, 0, self._admit, "gateway-link")
        self.key, self.node_id, self.loop = key, node_id, loop
        self.start_request, self.abort, self.progress = start, abort, progress
        self.refused = 0  # connections that did not prove the key

    def _admit(self, conn: socket.socket) -> None:
        """Handshake and request on this thread, then hand the connection to the event loop."""
        try:
            if not auth.answer_handshake(conn, self.key, self.node_id, MAGIC):
                self.refused += 1
                conn.close()
                return
            receiver = _read_receiver(conn)
            conn.setblocking(False)
            self.serve_on(self.loop, self._serve(conn, receiver))
        except (OSError, ValueError) as exc:
            log.info("gateway link %s: connection refused: %s", self.node_id, exc)
            conn.close()

    async def _serve(self, conn: socket.socket, receiver: str) -> None:
        """Start each submission as it arrives; the gateway's end closing (or a malformed request) aborts
        the connection's requests, as closing a Ray stream does."""
        sink = ReceiverSink(FrameSender(conn, self.loop), self.loop, self.progress)
        try:
            while True:
                request_id, prompt, params = _submission(await read_socket_frame(self.loop, conn))
                sink.submitted(request_id)
                self.start_request(request_id, prompt, params, sink)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (ValueError, pickle.UnpicklingError) as exc:
            log.warning("gateway link %s: receiver %s sent a malformed request: %s", self.node_id, receiver, exc)
        except Exception:  # nobody awaits this task: say what ended it
            log.exception("gateway link %s: connection of receiver %s failed", self.node_id, receiver)
        finally:
            sink.sender.close()
            conn.close()
            for request_id in sink.live():
                self.abort(request_id)


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
