"""One node's outputs to one receiver, coalesced: a streamed message per batch, not per token per request.

A gateway streaming each request over its own Ray generator pays one object, one
round of serialization and one wake-up per token per request. Here a receiver (a
gateway process) holds one `outputs` stream per node; every request it submits
pushes its outputs into the receiver's queue, and the stream sends whatever has
gathered as one list. The engine thread hands a whole step's outputs over at once,
so a message carries about one step's outputs of all the receiver's requests.

The receiver keys the outputs by `request_id`; a request that fails after it was
accepted shows up as a `StreamFailed` in its place. When a receiver's stream closes
(the gateway went away), its requests are aborted. This is the Ray stream's side; a
gateway's direct link is written by the engine thread (orchard/node/serving/gateway_link.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from orchard.node.types import RequestOutput

#: streams(on_accepted) -> the request's outputs; on_accepted() runs once the engine took it
OutputSource = Callable[[Callable[[], None]], AsyncIterator[RequestOutput]]


@dataclass(frozen=True)
class StreamFailed:
    """The request `request_id` failed after it was accepted (an engine step raised)."""

    request_id: str
    message: str


class Subscribers:
    """Per receiver, the queue its `outputs` stream drains, and the tasks feeding it."""

    def __init__(self):
        self._queues: dict[str, asyncio.Queue] = {}
        self._pumps: dict[str, tuple[str, asyncio.Task]] = {}  # request id -> (receiver, task)

    def _queue(self, receiver: str) -> asyncio.Queue:
        return self._queues.setdefault(receiver, asyncio.Queue())

    async def submit(self, receiver: str, request_id: str, source: OutputSource) -> None:
        """Start the request; returns once the engine accepted it, raises what the engine refused it with."""
        accepted = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self._pump(self._queue(receiver), request_id, source, accepted))
        self._pumps[request_id] = (receiver, task)
        task.add_done_callback(lambda _: self._pumps.pop(request_id, None))
        await accepted

    async def outputs(self, receiver: str) -> AsyncIterator[list]:
        """Batches of the receiver's outputs, as they gather; closing it aborts the receiver's requests."""
        queue = self._queue(receiver)
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            self._queues.pop(receiver, None)
            for owner, task in list(self._pumps.values()):
                if owner == receiver:
                    task.cancel()

    @staticmethod
    async def _pump(queue: asyncio.Queue, request_id: str, source: OutputSource, accepted: asyncio.Future) -> None:
        def on_accepted() -> None:
            if not accepted.done():
                accepted.set_result(None)

        try:
            async for output in source(on_accepted):
                queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused: the submitter gets it; later: the receiver does
            if not accepted.done():
                accepted.set_exception(exc)
            else:
                queue.put_nowait(StreamFailed(request_id, repr(exc)))
        finally:
            if not accepted.done():
                accepted.cancel()
