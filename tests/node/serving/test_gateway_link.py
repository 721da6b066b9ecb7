"""A gateway's direct link to a node, without Ray: the node's listener on an event loop, an engine
stand-in handing its sink answers and outputs from a thread of its own as the engine thread does, a
gateway's end speaking to it. Pins the handshake (wrong key, wrong node refused and counted, nothing
started), submissions answered (accepted, or refused with the engine's error), a step's outputs going
out as one message of deltas, and the gateway leaving, or sending something that is not a
submission, aborting its unfinished requests on the node."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orchard.node.errors import EngineError, PromptTooLong
from orchard.node.serving.gateway_link import (
    Accepted,
    GatewayLinkServer,
    Refused,
    gateway_link_key,
    open_gateway_link,
    read_messages,
)
from orchard.node.serving.link_auth import LinkRefused
from orchard.node.serving.link_io import write_frame
from orchard.node.serving.output_streams import StreamFailed
from orchard.node.types import CompletionOutput, RequestOutput, SamplingParams

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


class Engine:
    """What the node hands the listener, standing in for the engine thread: `start` plays the request's
    script on a thread of its own (refusing long prompts and [0]); each script step is either a list
    of outputs, handed to the sink as one step's, or an exception the step raised."""

    def __init__(self):
        self.scripts, self.started, self.aborted, self.progress = {}, [], [], []

    def start(self, request_id, prompt, params, sink):
        self.started.append((request_id, prompt, params))
        threading.Thread(target=self._play, args=(request_id, prompt, sink)).start()

    def _play(self, request_id, prompt, sink):
        if len(prompt) > 100:
            return sink.refused(request_id, PromptTooLong(len(prompt), 100))
        if prompt == [0]:
            return sink.refused(request_id, Unpicklable("no way back"))
        sink.accepted(request_id)
        for step in self.scripts.get(request_id, []):
            if isinstance(step, Exception):
                return sink.failed(request_id, step)
            sink.outputs(step)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def on_progress(self, started, ended):
        self.progress.append((started, ended))


def run(scenario):
    """Run `scenario(server, engine)` with node "a" listening on loopback in the same event loop."""
    async def main():
        engine = Engine()
        server = GatewayLinkServer(KEY, "a", engine.start, engine.abort, engine.on_progress, asyncio.get_running_loop(),
                                   "127.0.0.1")
        server.start()
        try:
            return await asyncio.wait_for(scenario(server, engine), 20)
        finally:
            server.close()

    return asyncio.run(main())


async def connect(server, receiver: str, key: bytes = KEY, node: str = "a"):
    sock = await asyncio.to_thread(open_gateway_link, server.address, key, node, receiver)
    reader, writer = await asyncio.open_connection(sock=sock)
    return read_messages(reader), writer


async def until(messages, done) -> list:
    got = []
    async for batch in messages:
        got.extend(batch)
        if done(got):
            return got
    raise AssertionError(f"the stream ended after {got}")


def test_submissions_are_answered_and_their_outputs_follow_as_deltas_only():
    async def scenario(server, engine):
        engine.scripts["r1"] = [[output("r1", 5)], [output("r1", 6)], [output("r1", 7, finished=True)]]
        engine.scripts["r2"] = [[output("r2", 9, finished=True)]]
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1, 2, 3], PARAMS))
        write_frame(writer, ("submit", "r2", [4], PARAMS))
        got = await until(messages, lambda got: sum(isinstance(o, RequestOutput) and o.finished for o in got) == 2
                          and sum(isinstance(o, Accepted) for o in got) == 2)
        writer.close()
        return got, engine.started

    got, started = run(scenario)
    assert sorted(started) == [("r1", [1, 2, 3], PARAMS), ("r2", [4], PARAMS)]
    assert {o.request_id for o in got if isinstance(o, Accepted)} == {"r1", "r2"}
    by_request = {rid: [(o.outputs[0].token_ids_delta, o.outputs[0].text_delta) for o in got
                        if isinstance(o, RequestOutput) and o.request_id == rid] for rid in ("r1", "r2")}
    assert by_request == {"r1": [([5], "<5>"), ([6], "<6>"), ([7], "<7>")], "r2": [([9], "<9>")]}
    assert all(o.prompt_token_ids == [] and o.outputs[0].token_ids == [] for o in got if isinstance(o, RequestOutput))


def test_one_steps_outputs_of_a_connections_requests_go_out_as_one_message():
    async def scenario(server, engine):
        engine.scripts["r1"] = [[output("r1", 1), output("r2", 2, finished=True), output("r3", 3)]]
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        batches = []
        async for batch in messages:
            batches.append(batch)
            if any(isinstance(o, RequestOutput) for o in batch):
                break
        for _ in range(100):  # the progress report runs on the loop after the step went out
            if engine.progress:
                break
            await asyncio.sleep(0.02)
        writer.close()
        return batches, engine.progress

    batches, progress = run(scenario)
    assert [type(o) for o in batches[0]] == [Accepted]
    assert [(o.request_id, o.outputs[0].token_ids_delta) for o in batches[1]] == [("r1", [1]), ("r2", [2]), ("r3", [3])]
    assert progress == [(["r1", "r2", "r3"], True)]  # their first outputs went, and one of them ended


def test_a_refused_submission_comes_back_with_the_engines_error_and_the_link_stays():
    async def scenario(server, engine):
        engine.scripts["r1"] = [[output("r1", 4, finished=True)]]
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "long", list(range(101)), PARAMS))
        write_frame(writer, ("submit", "odd", [0], PARAMS))
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        got = await until(messages, lambda got: any(isinstance(o, RequestOutput) and o.finished for o in got)
                          and sum(isinstance(o, Refused) for o in got) == 2)
        writer.close()
        return {o.request_id: o for o in got if isinstance(o, Refused)}

    refused = run(scenario)
    assert isinstance(refused["long"].error, PromptTooLong)
    assert (refused["long"].error.prompt_tokens, refused["long"].error.max_model_len) == (101, 100)
    # An error that would not survive the pickle comes back named, as the engine's base error.
    assert type(refused["odd"].error) is EngineError and "Unpicklable: no way back" in str(refused["odd"].error)


def test_a_request_failing_after_it_was_accepted_arrives_as_stream_failed():
    async def scenario(server, engine):
        engine.scripts["r1"] = [[output("r1", 1)], RuntimeError("step broke")]
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        got = await until(messages, lambda got: any(isinstance(o, StreamFailed) for o in got))
        writer.close()
        return [o for o in got if not isinstance(o, Accepted)]

    got = run(scenario)
    assert got[0].outputs[0].token_ids_delta == [1]
    assert isinstance(got[1], StreamFailed) and got[1].request_id == "r1" and "step broke" in got[1].message


def test_a_gateway_without_the_key_is_refused_counted_and_starts_nothing():
    async def scenario(server, engine):
        with pytest.raises(LinkRefused):
            await connect(server, "gw-x", key=gateway_link_key("another-cluster-token-of-32-characters"))
        for _ in range(100):  # the listener counts it on its own thread
            if server.refused:
                break
            await asyncio.sleep(0.02)
        return server.refused, engine.started

    refused, started = run(scenario)
    assert refused == 1 and started == []


def test_a_gateway_reaching_another_node_than_it_meant_refuses_it():
    async def scenario(server, engine):
        with pytest.raises(LinkRefused, match="not node 'b'"):
            await connect(server, "gw-x", node="b")

    run(scenario)


@pytest.mark.parametrize("leaving", ["closes its end", "sends what is not a submission"])
def test_the_gateway_leaving_aborts_its_unfinished_requests_on_the_node(leaving):
    async def scenario(server, engine):
        engine.scripts["r1"] = [[output("r1", 3)]]  # still running
        engine.scripts["r2"] = [[output("r2", 4, finished=True)]]
        messages, writer = await connect(server, "gw-1")
        write_frame(writer, ("submit", "r1", [1], PARAMS))
        write_frame(writer, ("submit", "r2", [1], PARAMS))
        first = await until(messages, lambda got: sum(isinstance(o, RequestOutput) for o in got) == 2)
        if leaving == "closes its end":
            await messages.aclose()
            writer.close()
        else:
            write_frame(writer, ("run", "print('hello')"))
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.02)
        return first, engine.aborted

    first, aborted = run(scenario)
    assert sorted(o.outputs[0].token_ids_delta[0] for o in first if isinstance(o, RequestOutput)) == [3, 4]
    assert aborted == ["r1"]  # the finished one is left alone
