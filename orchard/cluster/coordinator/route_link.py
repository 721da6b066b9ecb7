"""The coordinator's `route` and `prefill_done` over a gateway's direct connection, instead of Ray calls.

Why: `route` is the one coordinator call a request waits for, and as a Ray call it took
1.9-2.3 ms round trip on the 2-core VM, 1.2-1.5 of which a call that does nothing costs
(docs/benchmarks.md, "The route over a direct link"). Here a call is one pickle, one write
and one read each way. A request's other call, `prefill_done`, waits for no answer, so it goes
the same way as a notice with no reply: as a Ray call it cost both processes CPU in Ray's
threads. A gateway without the link (no key, no address, the connection lost) makes both
Ray calls as before; every other coordinator call stays a Ray call.

The listener serves the coordinator's Ray actor (`orchard.cluster.coordinator.service`) on its event
loop, where Ray runs the actor's methods one at a time: the state still needs no locks.

The connection opens with `orchard.node.serving.link_auth`'s handshake under its own magic and key;
the listener proves the name "coordinator". Then, each frame a u32 length and a pickle:

    gateway -> coordinator   (call_id, args): the positional arguments of `Coordinator.route`
    coordinator -> gateway   (call_id, RouteDecision, None) or (call_id, None, error)
    gateway -> coordinator   ("prefill_done", (node_id, request_id)): no reply

Pickle is what Ray itself sends between these processes; it is only read from a peer that
proved the cluster's key.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from orchard.cluster.coordinator.coordinator import Coordinator
from orchard.cluster.coordinator.router import RouteDecision
from orchard.node.serving import link_auth as auth
from orchard.node.serving.link_io import Listener, read_frame, write_frame

log = logging.getLogger(__name__)

MAGIC = b"ORRTLNK1"
KEY_PURPOSE = "route-link-v1"
NAME = "coordinator"  # what the listener proves it is
PREFILL_DONE = "prefill_done"  # a notice's tag, where a call has its id


def route_link_key(secret: str | None, environ=None) -> bytes | None:
    """The route link's key from `secret` or the environment's Ray token; None: no link."""
    return auth.link_key(secret, environ, KEY_PURPOSE)


class RouteLinkServer(Listener):
    """Gateways' connections: authenticated on threads (the handshake blocks), then served on the
    coordinator's event loop."""

    def __init__(self, key: bytes, coordinator: Coordinator, loop: asyncio.AbstractEventLoop, host: str):
        super().__init__(host, 0, self._admit, "route-link")
        self.key, self.coordinator, self.loop = key, coordinator, loop
        self.refused = 0  # connections that did not prove the key
        self.connections = 0  # connections that did
        self.calls = 0  # calls answered, with a decision or an error
        self.notices = 0  # prefill_done notices applied

    def _admit(self, conn: socket.socket) -> None:
        try:
            if not auth.answer_handshake(conn, self.key, NAME, MAGIC):
                self.refused += 1
                conn.close()
                return
            self.connections += 1
            conn.setblocking(False)
            self.serve_on(self.loop, self._serve(conn))
        except OSError as exc:
            log.info("route link: connection refused: %s", exc)
            conn.close()

    async def _serve(self, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        try:
            while True:
                call_id, args = _call(await read_frame(reader))
                if call_id == PREFILL_DONE:
                    self.coordinator.prefill_done(*args)
                    self.notices += 1
                    continue
                try:
                    reply = (call_id, self.coordinator.route(*args), None)
                except Exception as exc:  # NoNodeAvailable and the like: the gateway raises it
                    reply = (call_id, None, exc)
                self.calls += 1
                write_frame(writer, reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the gateway left
        except Exception:  # a malformed call ends the connection; nobody awaits this task: say why
            log.exception("route link: a gateway's connection failed")
        finally:
            writer.close()


def _call(frame: object) -> tuple[int | str, tuple]:
    """(call id, route's arguments) or (PREFILL_DONE, (node_id, request_id)); anything else is refused."""
    shaped = isinstance(frame, tuple) and len(frame) == 2 and isinstance(frame[1], tuple)
    if not shaped or not (isinstance(frame[0], int) or (frame[0] == PREFILL_DONE and len(frame[1]) == 2)):
        raise ValueError("not a route call")
    return frame


class RouteLink:
    """A gateway's end: calls in flight at once, answers matched by id. `closed` once the connection
    is gone; every call then waiting raises ConnectionError."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._writer, self._ids, self._calls = writer, itertools.count(), {}
        self._task = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def open(cls, address: str, key: bytes) -> RouteLink:
        """Connect and prove the key (raises OSError or `link_auth.LinkRefused` when no link can be made)."""
        sock = await asyncio.to_thread(_connect, address, key)
        return cls(*await asyncio.open_connection(sock=sock))

    @property
    def closed(self) -> bool:
        return self._task.done()

    async def route(self, *args) -> RouteDecision:
        if self.closed:
            raise ConnectionError("the route link is closed")
        call_id, answer = next(self._ids), asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            write_frame(self._writer, (call_id, args))
            await self._writer.drain()
            return await answer
        finally:
            self._calls.pop(call_id, None)

    def prefill_done(self, node_id: str, request_id: str) -> None:
        """A notice: written now, answered never (raises ConnectionError once the link is gone)."""
        if self.closed or self._writer.is_closing():
            raise ConnectionError("the route link is closed")
        write_frame(self._writer, (PREFILL_DONE, (node_id, request_id)))

    def close(self) -> None:
        self._task.cancel()
        self._writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, decision, error = await read_frame(reader)
                answer = self._calls.get(call_id)
                if answer is not None and not answer.done():
                    answer.set_result(decision) if error is None else answer.set_exception(error)
        except Exception as exc:  # closed, cut off or garbled: nothing more will be answered
            for answer in self._calls.values():
                if not answer.done():
                    answer.set_exception(ConnectionError(f"the route link ended: {exc!r}"))


def _connect(address: str, key: bytes) -> socket.socket:
    sock = auth.dial(address, key, NAME, MAGIC)
    sock.settimeout(None)
    return sock


class RouteLinks:
    """A gateway's route link for the event loop it serves on: opened once by the first call (calls that
    come meanwhile wait for that opening, not open links of their own), dropped when it breaks, tried
    again `RETRY_S` after none could be made (Ray routes meanwhile)."""

    RETRY_S = 10.0

    def __init__(self, key: bytes | None, address: Callable[[], Awaitable[str]]):
        self.key, self._address = key, address  # address(): the coordinator's `route_link`, "" without a key
        self._current: tuple[asyncio.AbstractEventLoop, asyncio.Task, float] | None = None  # (loop, opening, when)
        self.calls = 0  # routes decided over a link
        self.notices = 0  # prefill_done notices sent over a link
        self.openings = 0  # links asked for: the first, and one after each that broke or could not be made
        self.through_ray: Counter[str] = Counter()  # why a route was left to Ray: "no link", "link broke"

    @property
    def connected(self) -> bool:
        link = self._opened()
        return link is not None and not link.closed

    async def route(self, *args) -> RouteDecision | None:
        """The decision over the link; None when there is none, or it just broke (route through Ray).
        The coordinator's errors (NoNodeAvailable) are raised as they come back."""
        link = await self._link()
        if link is None:
            self.through_ray["no link"] += 1
            return None
        try:
            decision = await link.route(*args)
        except ConnectionError:
            self.through_ray["link broke"] += 1
            if self._opened() is link:
                self._current = None  # the coordinator restarted, or went: the next call connects again
            return None
        self.calls += 1
        return decision

    def prefill_done(self, node_id: str, request_id: str) -> bool:
        """Tell the coordinator over the link, if one is open now (no opening is waited for);
        False: the caller tells it through Ray."""
        link = self._opened()
        if link is None or self._current[0] is not asyncio.get_running_loop():
            return False
        try:
            link.prefill_done(node_id, request_id)
        except ConnectionError:
            return False
        self.notices += 1
        return True

    def _opened(self) -> RouteLink | None:
        """The link the last opening made, once it is made."""
        if self._current is None or not self._current[1].done() or self._current[1].cancelled():
            return None
        return self._current[1].result()

    async def _link(self) -> RouteLink | None:
        loop, now = asyncio.get_running_loop(), time.monotonic()
        if self._current is None or self._current[0] is not loop or self._spent(now):
            self._current = (loop, loop.create_task(self._open()), now)
            self.openings += 1
        return await asyncio.shield(self._current[1])  # a caller that leaves does not cancel the others' opening

    def _spent(self, now: float) -> bool:
        """Whether the current opening is over and its link broke, or none was made `RETRY_S` ago."""
        opening, since = self._current[1:]
        if not opening.done():
            return False
        link = self._opened()
        return link.closed if link is not None else opening.cancelled() or now - since >= self.RETRY_S

    async def _open(self) -> RouteLink | None:
        if self.key is None:
            return None
        try:
            address = await self._address()
            return await RouteLink.open(address, self.key) if address else None
        except Exception as exc:  # whatever kept the link from being made, Ray routes: it reports real trouble itself
            log.warning("no route link to the coordinator (%r); routing through Ray", exc)
            return None
