"""The gateway's readers of node output streams, over Ray streams of stand-in actors: a request
that still holds the handle of a node's dead actor (its name now another actor's) must fail alone,
never ending the stream of the actor that replaced it (under `orchard serve`, that made the gateway
report the new actor's node lost)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray.exceptions as rex

from orchard.cluster.gateway.node_streams import NodeLost, NodeStreams, next_item
from orchard.node.types import CompletionOutput, RequestOutput


class StandInActor:
    """What NodeStreams uses of a node actor handle: its id and its `outputs` Ray stream. A dead one's
    stream fails at once; a live one's yields what the test puts on `batches`, and ends at a None."""

    def __init__(self, actor_id: str, alive: bool):
        self._actor_id, self.alive, self.batches = actor_id, alive, asyncio.Queue()
        self.outputs = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._stream))

    async def _stream(self, receiver: str):
        if not self.alive:
            raise rex.RayActorError()
        while (batch := await self.batches.get()) is not None:
            yield asyncio.sleep(0, result=batch)  # what a Ray stream yields: awaitables


def output(request_id: str, token: int) -> RequestOutput:
    return RequestOutput(request_id, [1, 2], [CompletionOutput(0, token_ids=[token], token_ids_delta=[token])])


def test_a_request_on_a_dead_actors_handle_does_not_end_the_stream_of_the_actor_that_replaced_it():
    async def scenario():
        streams, new, dead = NodeStreams(), StandInActor("new", alive=True), StandInActor("old", alive=False)
        live_queue, _ = streams.open("n", new, "on-new")
        await asyncio.sleep(0.05)  # the new actor's reader runs
        stale_queue, _ = streams.open("n", dead, "on-old")  # a request still holding the old handle
        with pytest.raises(NodeLost):
            await asyncio.wait_for(next_item(stale_queue), 5)
        new.batches.put_nowait([output("on-new", 7)])
        first = await asyncio.wait_for(next_item(live_queue), 5)
        again, _ = streams.open("n", new, "on-new-2")  # later requests share the live reader
        new.batches.put_nowait([output("on-new-2", 8)])
        second = await asyncio.wait_for(next_item(again), 5)
        new.batches.put_nowait(None)
        with pytest.raises(NodeLost):  # what a request still waiting gets when the live stream ends
            await asyncio.wait_for(next_item(streams.open("n", new, "late")[0]), 5)
        return first, second

    first, second = asyncio.run(scenario())
    assert first.outputs[0].token_ids == [7] and second.outputs[0].token_ids == [8]
