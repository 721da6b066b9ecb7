"""The gateway's end of the nodes' coalesced output streams (node/serving/output_streams.py).

One output stream per node for this gateway process, read by one task that fans each
message's outputs out to the queues of the requests waiting for them. The stream is the
node's direct output link (`node.serving.output_link`) when the gateway holds the cluster's
key and the node listens, else the node's `outputs` Ray stream. A stream that
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

from node.serving.link_auth import LinkRefused
from node.serving.output_link import open_output_link, read_messages
from node.types import RequestOutput

log = logging.getLogger(__name__)


class NodeLost(RuntimeError):
    """The node serving a stream went away."""


@dataclass
class _Reader:
    """The task reading one node actor's stream, under its own receiver name."""

    task: asyncio.Task
    name: str
    actor_id: object  # the incarnation it reads: a replaced actor keeps the node id, not this


class NodeStreams:
    """Per node one reader task; per (node, request id on that node) one queue, tied to the reader it waits on."""

    def __init__(self, key: bytes | None = None):
        self.receiver = f"gateway-{uuid.uuid4().hex[:12]}"
        self._key = key  # the nodes' output link key (node.serving.output_link); None: Ray streams only
        self.direct_readers = 0  # readers that got a direct link (each event loop's readers are its own)
        self._direct: set[str] = set()  # their names
        self._queues: dict[tuple[str, str], tuple[asyncio.Queue, str]] = {}  # -> (queue, its reader's name)
        self._readers: dict[str, _Reader] = {}
        self._numbers = itertools.count()
        self.messages = 0  # messages received, for tests and stats: about one per engine step
        self.outputs = 0

    def open(self, node_id: str, actor, request_id: str) -> tuple[asyncio.Queue, str]:
        """The queue `request_id`'s outputs from `node_id` will arrive on, and the receiver name to
        submit it under; starts reading the node if no reader runs for this actor (each reader its
        own name, so a stream left behind by an ended event loop, or by the node's previous actor,
        never takes another reader's outputs)."""
        reader = self._readers.get(node_id)
        if reader is None or reader.task.done() or reader.actor_id != actor._actor_id:
            if reader is not None:
                reader.task.cancel()  # it read an actor this node no longer has
            name = f"{self.receiver}-{next(self._numbers)}"
            task = asyncio.get_running_loop().create_task(self._read(node_id, actor, name))
            reader = self._readers[node_id] = _Reader(task, name, actor._actor_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[(node_id, request_id)] = (queue, reader.name)
        return queue, reader.name

    @property
    def direct_links(self) -> int:
        """Nodes whose outputs this gateway reads over a direct link now."""
        return sum(1 for r in self._readers.values() if r.name in self._direct and not r.task.done())

    def close(self, node_id: str, request_id: str) -> None:
        self._queues.pop((node_id, request_id), None)

    def shutdown(self) -> None:
        for reader in self._readers.values():
            reader.task.cancel()

    async def _read(self, node_id: str, actor, name: str) -> None:
        messages = None
        try:
            messages = await self._messages(node_id, actor, name)
            async for batch in messages:
                self.messages += 1
                self.outputs += len(batch)
                for item in batch:
                    waiting = self._queues.get((node_id, item.request_id))
                    if waiting is not None and waiting[1] == name:
                        waiting[0].put_nowait(item)
            lost = NodeLost("the node's output stream ended")
        except asyncio.CancelledError:
            raise  # closing `messages` below ends the stream: the node then aborts this reader's requests
        except Exception as exc:  # the actor died, its raylet went away, the link broke, or Ray is shutting down
            lost = NodeLost(repr(exc))
        finally:
            if messages is not None:
                await messages.aclose()
        log.warning("output stream of node %s closed: %s", node_id, lost)
        reader = self._readers.get(node_id)
        if reader is not None and reader.name == name:
            del self._readers[node_id]
        for (node, _), (queue, reader_name) in list(self._queues.items()):
            if node == node_id and reader_name == name:
                queue.put_nowait(lost)

    async def _messages(self, node_id: str, actor, name: str) -> AsyncIterator[list]:
        """The node's messages for `name`: over its direct output link when it has one we hold the key
        to, else over its Ray stream."""
        if self._key is not None:
            address = (await actor.info.remote()).get("output_link")
            if address:
                try:
                    sock = await asyncio.to_thread(open_output_link, address, self._key, node_id, name)
                except (OSError, LinkRefused) as exc:
                    log.warning("node %s: no direct output link (%s); reading its Ray stream", node_id, exc)
                else:
                    self.direct_readers += 1
                    self._direct.add(name)
                    return read_messages(sock)
        return _ray_messages(actor, name)


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
