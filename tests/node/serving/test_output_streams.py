"""Coalesced output streams: refusals reach the submitter, later failures the receiver, a closed stream aborts."""

from __future__ import annotations

import asyncio

import pytest

from orchard.node.serving.output_streams import StreamFailed, Subscribers
from orchard.node.types import CompletionOutput, RequestOutput


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, token_ids_delta=[token], finish_reason="length" if finished else None)
    return RequestOutput(request_id, [], [completion], finished=finished)


class Steps:
    """Stand-in for the engine's steps: token i of every request comes out at step i + 1."""

    def __init__(self):
        self.done = 0
        self.changed = asyncio.Condition()

    async def step(self):
        async with self.changed:
            self.done += 1
            self.changed.notify_all()

    async def reach(self, n: int):
        async with self.changed:
            await self.changed.wait_for(lambda: self.done >= n)


def source(request_id: str, tokens: int, steps: Steps, fail_after: int | None = None, refuse: bool = False):
    async def stream(on_accepted):
        if refuse:
            raise ValueError("prompt too long")
        on_accepted()
        for i in range(tokens):
            await steps.reach(i + 1)
            if fail_after is not None and i == fail_after:
                raise RuntimeError("step failed")
            yield output(request_id, i, finished=i == tokens - 1)

    return stream


def test_outputs_of_several_requests_arrive_together_and_failures_in_place():
    async def scenario():
        subs, steps = Subscribers(), Steps()
        await subs.submit("g", "a", source("a", 3, steps))
        await subs.submit("g", "b", source("b", 3, steps, fail_after=1))
        with pytest.raises(ValueError, match="too long"):
            await subs.submit("g", "c", source("c", 3, steps, refuse=True))
        batches, reader = [], subs.outputs("g")
        for _ in range(3):
            await steps.step()  # both requests produce, then the stream drains them as one message
            await asyncio.sleep(0.01)
            batches.append(await asyncio.wait_for(reader.__anext__(), 5))
        kinds = [[(type(i).__name__, i.request_id) for i in batch] for batch in batches]
        assert kinds[0] == [("RequestOutput", "a"), ("RequestOutput", "b")]
        assert ("StreamFailed", "b") in kinds[1] and all(isinstance(i, (RequestOutput, StreamFailed)) for b in batches for i in b)
        assert batches[-1][-1].finished
        await reader.aclose()

    asyncio.run(scenario())


def test_closing_a_receivers_stream_stops_its_requests():
    async def scenario():
        subs = Subscribers()
        await subs.submit("g", "a", source("a", 5, Steps()))
        reader = subs.outputs("g")
        waiting = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await reader.aclose()
        await asyncio.sleep(0.01)
        assert subs._pumps == {}  # the request's task was cancelled (the engine aborts it)

    asyncio.run(scenario())
