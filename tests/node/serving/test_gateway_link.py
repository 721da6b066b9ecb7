"""A gateway's direct link to a node, without Ray: the node's listener on an event loop with its
`Subscribers`, a gateway's end speaking to it. Pins the handshake (wrong key, wrong node refused and
counted, nothing subscribed), submissions answered (accepted, or refused with the engine's error),
outputs arriving as the node gathered them, and the gateway leaving, or sending something that is
not a submission, aborting its requests on the node."""

from __future__ import annotations

import asyncio

import pytest

from node.errors import EngineError, PromptTooLong
from node.serving.gateway_link import (
    Accepted,
    GatewayLinkServer,
    Refused,
    gateway_link_key,
    open_gateway_link,
    read_messages,
)
from node.serving.link_auth import LinkRefused
from node.serving.link_io import write_frame
from node.serving.output_streams import StreamFailed, Subscribers
from node.types import CompletionOutput, RequestOutput, SamplingParams

KEY = gateway_link_key("a-cluster-token-of-at-least-32-characters")
PARAMS = SamplingParams(max_tokens=3, temperature=0.0)


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    delta = CompletionOutput(0, token_ids_delta=[token], text_delta=f"<{token}>", finish_reason="length" if finished else None)
    return RequestOutput(request_id, [], [delta], finished=finished)


class Unpicklable(Exception):
    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        raise TypeError("not this one")


class Node:
    """What the node actor hands the listener: its subscribers and a submit that runs `sources[request_id]`."""

    def __init__(self):
        self.subscribers, self.sources, self.submitted = Subscribers(), {}, []

    async def submit(self, receiver, request_id, prompt, params):
        self.submitted.append((receiver, request_id, prompt, params))
        if len(prompt) > 100:
            raise PromptTooLong(len(prompt), 100)
        if prompt == [0]:
            raise Unpicklable("no way back")
        await self.subscribers.submit(receiver, request_id, self.sources[request_id])


def run(scenario):
    """Run `scenario(server, node)` with node "a" listening on loopback in the same event loop."""
    async def main():
        node = Node()
        server = GatewayLinkServer(KEY, "a", node.subscribers, node.submit, asyncio.get_running_loop(), "127.0.0.1")
        server.start()
        try:
            return await asyncio.wait_for(scenario(server, node), 20)
        finally:
            server.close()

    return asyncio.run(main())


async def connect(server, receiver: str, key: bytes = KEY, node: str = "a"):
    sock = await asyncio.to_thread(open_gateway_link, server.address, key, node, receiver)
    reader, writer = await asyncio.open_connection(sock=sock)
    return read_messages(reader), writer


def source_of(outputs: list, released: asyncio.Event | None = None, ended: list | None = None):
    """An engine stand-in: accepts, yields `outputs`, then (with `released`) waits for it."""
    async def source(on_accepted):
        on_accepted()
        try:
            for out in outputs:
                yield out
            if released is not None:
                await released.wait()
        finally:
            if ended is not None:
                ended.append(True)

    return source


async def until(messages, done) -> list:
    got = []
    async for batch in messages:
        got.extend(batch)
        if done(got):
            return got
    raise AssertionError(f"the stream ended after {got}")


def test_submissions_are_answered_and_their_outputs_follow_as_the_node_gathered_them():
    async def scenario(server, node):
        node.sources["r1"] = source_of([output("r1", 5), output("r1", 6), output("r1", 7, finished=True)])
        node.sources["r2"] = source_of([output("r2", 9, finished=True)])
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1, 2, 3], PARAMS))
        write_frame(writer, ("submit", "r2", [4], PARAMS))
        got = await until(messages, lambda got: sum(isinstance(o, RequestOutput) and o.finished for o in got) == 2
                          and sum(isinstance(o, Accepted) for o in got) == 2)
        writer.close()
        return got, node.submitted

    got, submitted = run(scenario)
    assert submitted == [("gw-1", "r1", [1, 2, 3], PARAMS), ("gw-1", "r2", [4], PARAMS)]
    assert {o.request_id for o in got if isinstance(o, Accepted)} == {"r1", "r2"}
    by_request = {rid: [(o.outputs[0].token_ids_delta, o.outputs[0].text_delta) for o in got
                        if isinstance(o, RequestOutput) and o.request_id == rid] for rid in ("r1", "r2")}
    assert by_request == {"r1": [([5], "<5>"), ([6], "<6>"), ([7], "<7>")], "r2": [([9], "<9>")]}


def test_a_refused_submission_comes_back_with_the_engines_error_and_the_link_stays():
    async def scenario(server, node):
        node.sources["r1"] = source_of([output("r1", 4, finished=True)])
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "long", list(range(101)), PARAMS))
        write_frame(writer, ("submit", "odd", [0], PARAMS))
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        got = await until(messages, lambda got: any(isinstance(o, RequestOutput) and o.finished for o in got))
        writer.close()
        return {o.request_id: o for o in got if isinstance(o, Refused)}

    refused = run(scenario)
    assert isinstance(refused["long"].error, PromptTooLong)
    assert (refused["long"].error.prompt_tokens, refused["long"].error.max_model_len) == (101, 100)
    # An error that would not survive the pickle comes back named, as the engine's base error.
    assert type(refused["odd"].error) is EngineError and "Unpicklable: no way back" in str(refused["odd"].error)


def test_a_request_failing_after_it_was_accepted_arrives_as_stream_failed():
    async def broken(on_accepted):
        on_accepted()
        yield output("r1", 1)
        raise RuntimeError("step broke")

    async def scenario(server, node):
        node.sources["r1"] = broken
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        got = await until(messages, lambda got: any(isinstance(o, StreamFailed) for o in got))
        writer.close()
        return [o for o in got if not isinstance(o, Accepted)]

    got = run(scenario)
    assert got[0].outputs[0].token_ids_delta == [1]
    assert isinstance(got[1], StreamFailed) and got[1].request_id == "r1" and "step broke" in got[1].message


def test_a_gateway_without_the_key_is_refused_counted_and_subscribes_to_nothing():
    async def scenario(server, node):
        with pytest.raises(LinkRefused):
            await connect(server, "gw-x", key=gateway_link_key("another-cluster-token-of-32-characters"))
        for _ in range(100):  # the listener counts it on its own thread
            if server.refused:
                break
            await asyncio.sleep(0.02)
        return server.refused, node.subscribers

    refused, subscribers = run(scenario)
    assert refused == 1
    assert "gw-x" not in subscribers._queues


def test_a_gateway_reaching_another_node_than_it_meant_refuses_it():
    async def scenario(server, node):
        with pytest.raises(LinkRefused, match="not node 'b'"):
            await connect(server, "gw-x", node="b")

    run(scenario)


@pytest.mark.parametrize("leaving", ["closes its end", "sends what is not a submission"])
def test_the_gateway_leaving_aborts_its_requests_on_the_node(leaving):
    async def scenario(server, node):
        released, ended = asyncio.Event(), []
        node.sources["r1"] = source_of([output("r1", 3)], released, ended)
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        first = await until(messages, lambda got: any(isinstance(o, RequestOutput) for o in got))
        if leaving == "closes its end":
            await messages.aclose()
            writer.close()
        else:
            write_frame(writer, ("run", "print('hello')"))
        for _ in range(200):
            if ended:
                break
            await asyncio.sleep(0.02)
        return first, list(ended), released.is_set()  # a copy: leaving the loop cancels what is left

    first, ended, released = run(scenario)
    assert [o.outputs[0].token_ids_delta for o in first if isinstance(o, RequestOutput)] == [[3]]
    assert ended == [True] and not released  # the request's source was closed, not finished
