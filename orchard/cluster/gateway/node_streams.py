"""The gateway's end of the nodes' coalesced output streams (orchard/node/serving/output_streams.py).

One output stream per node for this gateway process, read by one task that fans each
message's outputs out to the queues of the requests waiting for them. The stream is the
node's direct gateway link (`orchard.node.serving.gateway_link`) when the gateway holds the cluster's
key and the node listens, else the node's `outputs` Ray stream; over a link, requests are
submitted on it too (`submit`), and the node's answers come back among the outputs. A stream that
breaks or ends means its node is gone: every request waiting on it gets `NodeLost`,
which the caller turns into a resume elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from orchard.node.serving.gateway_link import Accepted, Refused, open_gateway_link, read_messages
from orchard.node.serving.link_auth import LinkRefused
from orchard.node.serving.link_io import write_frame
from orchard.node.types import RequestOutput

log = logging.getLogger(__name__)


class NodeLost(RuntimeError):
    """The node serving a stream went away."""


@dataclass
class _Reader:
    """The task reading one node actor's stream (one incarnation of the node), under its own receiver name."""

    task: asyncio.Task
    name: str
    link: asyncio.Future  # its gateway link's writer once connected, None when it reads a Ray stream


class NodeStreams:
    """Per node one reader task; per (node, request id on that node) one queue, tied to the reader it waits on."""

    def __init__(self, key: bytes | None = None):
        self.receiver = f"gateway-{uuid.uuid4().hex[:12]}"
        self._key = key  # the nodes' gateway link key (node.serving.gateway_link); None: Ray streams only
        self.direct_readers = 0  # readers that got a direct link (each event loop's readers are its own)
        self.direct_submissions = 0  # requests submitted over a link
        self._queues: dict[tuple[str, str], tuple[asyncio.Queue, str]] = {}  # -> (queue, its reader's name)
        self._answers: dict[tuple[str, str], tuple[asyncio.Future, str]] = {}  # submissions over a link, waiting
        self._readers: dict[tuple[str, object], _Reader] = {}  # (node id, actor id) -> its reader
        self._numbers = itertools.count()
        self.messages = 0  # messages received, for tests and stats: about one per engine step
        self.outputs = 0

    def open(self, node_id: str, actor, request_id: str) -> tuple[asyncio.Queue, str]:
        """The queue `request_id`'s outputs from `node_id` will arrive on, and the receiver name to
        submit it under; starts reading `actor` if no reader runs for it. Readers go by actor, not by
        node: a request still holding the handle of a node's actor that died (the node's name now
        another actor's) gets a reader of its own that fails alone, never ending the new actor's.
        Each reader has its own name, so a stream left behind by an ended event loop, or by the node's
        previous actor, never takes another reader's outputs."""
        key = (node_id, actor._actor_id)
        reader = self._readers.get(key)
        if reader is None or reader.task.done():
            name, link = f"{self.receiver}-{next(self._numbers)}", asyncio.get_running_loop().create_future()
            task = asyncio.get_running_loop().create_task(self._read(key, actor, name, link))
            reader = self._readers[key] = _Reader(task, name, link)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[(node_id, request_id)] = (queue, reader.name)
        return queue, reader.name

    @property
    def direct_links(self) -> int:
        """Nodes whose outputs this gateway reads over a direct link now."""
        return sum(1 for r in self._readers.values() if not r.task.done() and r.link.done() and r.link.result() is not None)

    async def submit(self, node_id: str, actor, request_id: str, prompt: list[int], params) -> bool:
        """Submit a request opened on `actor` over its gateway link: True once the engine took it; raises
        what the node refused it with, or NodeLost. False when the actor's reader has no link (the
        caller submits through Ray)."""
        reader = self._readers.get((node_id, actor._actor_id))
        writer = await asyncio.shield(reader.link) if reader is not None else None
        if writer is None:
            return False
        answer = asyncio.get_running_loop().create_future()
        self._answers[(node_id, request_id)] = (answer, reader.name)
        try:
            write_frame(writer, ("submit", request_id, prompt, params))
            await writer.drain()
            item = await answer
        except ConnectionError as exc:
            raise NodeLost(repr(exc)) from exc
        finally:
            self._answers.pop((node_id, request_id), None)
        if isinstance(item, Refused):
            raise item.error
        self.direct_submissions += 1
        return True

    def close(self, node_id: str, request_id: str) -> None:
        self._queues.pop((node_id, request_id), None)

    def shutdown(self) -> None:
        for reader in self._readers.values():
            reader.task.cancel()

    async def _read(self, key: tuple[str, object], actor, name: str, link: asyncio.Future) -> None:
        node_id = key[0]
        messages, writer, lost = None, None, NodeLost("the node's output stream ended")
        try:
            messages, writer = await self._messages(node_id, actor, name)
            link.set_result(writer)
            async for batch in messages:
                self.messages += 1
                self.outputs += len(batch)
                for item in batch:
                    self._route(node_id, name, item)
        except asyncio.CancelledError:
            raise  # closing `messages` below ends the stream: the node then aborts this reader's requests
        except Exception as exc:  # the actor died, its raylet went away, the link broke, or Ray is shutting down
            lost = NodeLost(repr(exc))
        finally:
            if not link.done():
                link.set_result(None)
            if messages is not None:
                await messages.aclose()
            if writer is not None:
                writer.close()
            self._end(key, name, lost)
        log.warning("output stream of node %s closed: %s", node_id, lost)

    def _route(self, node_id: str, name: str, item) -> None:
        if isinstance(item, (Accepted, Refused)):
            waiting = self._answers.get((node_id, item.request_id))
            if waiting is not None and waiting[1] == name and not waiting[0].done():
                waiting[0].set_result(item)
            return
        waiting = self._queues.get((node_id, item.request_id))
        if waiting is not None and waiting[1] == name:
            waiting[0].put_nowait(item)

    def _end(self, key: tuple[str, object], name: str, lost: NodeLost) -> None:
        """The reader `name` stopped: whoever waits on it, for outputs or for an answer, gets `lost`."""
        node_id = key[0]
        reader = self._readers.get(key)
        if reader is not None and reader.name == name:
            del self._readers[key]
        for (node, _), (queue, reader_name) in list(self._queues.items()):
            if node == node_id and reader_name == name:
                queue.put_nowait(lost)
        for (node, _), (answer, reader_name) in list(self._answers.items()):
            if node == node_id and reader_name == name and not answer.done():
                answer.set_exception(lost)

    async def _messages(self, node_id: str, actor, name: str) -> tuple[AsyncIterator[list], asyncio.StreamWriter | None]:
        """The node's messages for `name`, and the link's writer: over its gateway link when it has one we
        hold the key to, else over its Ray stream (no writer)."""
        if self._key is not None:
            address = (await actor.info.remote()).get("gateway_link")
            if address:
                try:
                    sock = await asyncio.to_thread(open_gateway_link, address, self._key, node_id, name)
                except (OSError, LinkRefused) as exc:
                    log.warning("node %s: no direct gateway link (%s); reading its Ray stream", node_id, exc)
                else:
                    reader, writer = await asyncio.open_connection(sock=sock)
                    self.direct_readers += 1
                    return read_messages(reader), writer
        return _ray_messages(actor, name), None


async def _ray_messages(actor, name: str) -> AsyncIterator[list]:
    stream = actor.outputs.options(num_returns="streaming").remote(name)
    try:
        async for ref in stream:
            yield await ref
    except (GeneratorExit, asyncio.CancelledError):
        _cancel(stream)
        raise


def _cancel(stream) -> None:
    try:
        ray.cancel(stream)
    except Exception as exc:  # the node may already be gone
        log.debug("cancel failed: %s", exc)


async def next_item(queue: asyncio.Queue) -> RequestOutput:
    """The next output on a request's queue; raises what the reader put there instead."""
    item = await queue.get()
    if isinstance(item, Exception):
        raise item
    return item
