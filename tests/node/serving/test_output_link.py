"""A node's outputs over its direct output link, without Ray: a listener on an event loop with
`Subscribers`, a gateway's end reading it. Pins the handshake (wrong key, wrong node refused and
counted, nothing subscribed), the messages arriving as the node gathered them, and the gateway
leaving aborting its requests on the node."""

from __future__ import annotations

import asyncio
import socket

import pytest

from node.serving.link_auth import LinkRefused
from node.serving.output_link import OutputLinkServer, open_output_link, output_link_key, read_messages
from node.serving.output_streams import StreamFailed, Subscribers
from node.types import CompletionOutput, RequestOutput

KEY = output_link_key("a-cluster-token-of-at-least-32-characters")


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    delta = CompletionOutput(0, token_ids_delta=[token], text_delta=f"<{token}>", finish_reason="length" if finished else None)
    return RequestOutput(request_id, [], [delta], finished=finished)


def run(coroutine_fn):
    """Run `coroutine_fn(server, subscribers)` with node "a" listening on loopback in the same loop."""
    async def main():
        subscribers = Subscribers()
        server = OutputLinkServer(KEY, "a", subscribers, asyncio.get_running_loop(), "127.0.0.1")
        server.start()
        try:
            return await asyncio.wait_for(coroutine_fn(server, subscribers), 20)
        finally:
            server.close()

    return asyncio.run(main())


async def connect(server, receiver: str, key: bytes = KEY, node: str = "a") -> socket.socket:
    return await asyncio.to_thread(open_output_link, server.address, key, node, receiver)


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


def test_outputs_reach_the_gateway_as_the_node_gathered_them():
    async def scenario(server, subscribers):
        sock = await connect(server, "gw-1")
        messages = read_messages(sock)
        await subscribers.submit("gw-1", "r1", source_of([output("r1", 5), output("r1", 6), output("r1", 7, finished=True)]))
        await subscribers.submit("gw-1", "r2", source_of([output("r2", 9, finished=True)]))
        got = []
        async for batch in messages:
            got.extend(batch)
            if sum(o.finished for o in got) == 2:
                break
        await messages.aclose()
        return got

    got = run(scenario)
    by_request = {rid: [(o.outputs[0].token_ids_delta, o.outputs[0].text_delta) for o in got if o.request_id == rid]
                  for rid in ("r1", "r2")}
    assert by_request == {"r1": [([5], "<5>"), ([6], "<6>"), ([7], "<7>")], "r2": [([9], "<9>")]}
    assert [o.finished for o in got if o.request_id == "r1"] == [False, False, True]


def test_a_request_failing_after_it_was_accepted_arrives_as_stream_failed():
    async def broken(on_accepted):
        on_accepted()
        yield output("r1", 1)
        raise RuntimeError("step broke")

    async def scenario(server, subscribers):
        sock = await connect(server, "gw-1")
        messages = read_messages(sock)
        await subscribers.submit("gw-1", "r1", broken)
        got = []
        async for batch in messages:
            got.extend(batch)
            if any(isinstance(o, StreamFailed) for o in got):
                break
        await messages.aclose()
        return got

    got = run(scenario)
    assert got[0].outputs[0].token_ids_delta == [1]
    assert isinstance(got[1], StreamFailed) and got[1].request_id == "r1" and "step broke" in got[1].message


def test_a_gateway_without_the_key_is_refused_counted_and_subscribes_to_nothing():
    async def scenario(server, subscribers):
        with pytest.raises(LinkRefused):
            await connect(server, "gw-x", key=output_link_key("another-cluster-token-of-32-characters"))
        for _ in range(100):  # the listener counts it on its own thread
            if server.refused:
                break
            await asyncio.sleep(0.02)
        return server.refused, subscribers

    refused, subscribers = run(scenario)
    assert refused == 1
    assert "gw-x" not in subscribers._queues


def test_a_gateway_reaching_another_node_than_it_meant_refuses_it():
    async def scenario(server, subscribers):
        with pytest.raises(LinkRefused, match="not node 'b'"):
            await connect(server, "gw-x", node="b")

    run(scenario)


def test_the_gateway_leaving_aborts_its_requests_on_the_node():
    async def scenario(server, subscribers):
        released, ended = asyncio.Event(), []
        sock = await connect(server, "gw-1")
        messages = read_messages(sock)
        await subscribers.submit("gw-1", "r1", source_of([output("r1", 3)], released, ended))
        first = await anext(messages)
        await messages.aclose()  # closes the socket: the node sees its end close
        for _ in range(200):
            if ended:
                break
            await asyncio.sleep(0.02)
        return first, list(ended), released.is_set()  # a copy: leaving the loop cancels what is left

    first, ended, released = run(scenario)
    assert first[0].outputs[0].token_ids_delta == [3]
    assert ended == [True] and not released  # the request's source was closed, not finished
