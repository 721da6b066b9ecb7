"""The streaming client against scripted SSE responses (httpx's mock transport)."""

import asyncio
import json

import httpx
import pytest

from orchard.cluster.bench.loadgen.client import EndpointConfig, Outgoing, StreamClient
from orchard.cluster.bench.loadgen.datasets import Conversation, Turn
from orchard.cluster.bench.loadgen.runner import LoadConfig, run_load


def sse(*events, done=True) -> bytes:
    lines = [": keepalive 1/2\n\n"] + [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def text_chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat_chunk(text):
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}


def send(handler, req, endpoint=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            client = StreamClient(endpoint or EndpointConfig("http://server"), http)
            return await client.send(req, run_start=0.0)

    return asyncio.run(go())


PROMPT = Outgoing(conversation_id=0, turn=0, input_tokens=6, max_tokens=8, prompt="a b c")


def test_usage_chunk_gives_token_counts_over_chunk_count():
    body = sse(text_chunk("a"), text_chunk("b"), text_chunk("c"), text_chunk("", "length"), USAGE)
    rec = send(lambda r: httpx.Response(200, content=body), PROMPT)
    assert rec.success
    assert (rec.output_tokens, rec.prompt_tokens, rec.token_source) == (5, 7, "usage")
    assert rec.content_chunks == 3 and rec.text == "abc"
    assert len(rec.itl_s) == 2 and rec.ttft_s <= rec.e2el_s


def test_without_usage_each_text_chunk_counts_as_one_token():
    body = sse(text_chunk("a"), text_chunk(""), text_chunk("b"), text_chunk("", "stop"))
    rec = send(lambda r: httpx.Response(200, content=body), PROMPT)
    assert (rec.output_tokens, rec.token_source, rec.prompt_tokens) == (2, "chunks", None)


def test_chat_deltas_are_read_and_request_body_asks_for_usage():
    seen = {}

    def handler(request):
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, content=sse(chat_chunk("hi"), chat_chunk(" there")))

    msgs = ({"role": "user", "content": "hello"},)
    req = Outgoing(conversation_id=1, turn=0, input_tokens=1, max_tokens=4, messages=msgs)
    rec = send(handler, req, EndpointConfig("http://server/", model="m", api_key="sk-test"))
    assert rec.text == "hi there" and rec.output_tokens == 2
    assert seen["path"] == "/v1/chat/completions"
    assert seen["auth"] == "Bearer sk-test"
    assert seen["body"]["stream_options"] == {"include_usage": True}
    assert seen["body"]["messages"] == [{"role": "user", "content": "hello"}]
    assert (seen["body"]["model"], seen["body"]["max_tokens"], seen["body"]["stream"]) == ("m", 4, True)


def test_http_error_is_recorded_not_raised():
    rec = send(lambda r: httpx.Response(503, json={"error": {"message": "busy"}}), PROMPT)
    assert not rec.success
    assert rec.error.startswith("HTTP 503") and "busy" in rec.error
    assert rec.e2el_s is None


def test_error_event_inside_the_stream_fails_the_request():
    body = sse(text_chunk("a"), {"error": {"message": "engine died"}})
    rec = send(lambda r: httpx.Response(200, content=body), PROMPT)
    assert "engine died" in rec.error


def test_connection_failure_is_recorded_not_raised():
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    rec = send(handler, PROMPT)
    assert rec.error.startswith("ConnectError")


def test_run_continues_past_failures_and_records_every_request():
    calls = []

    def handler(request):
        calls.append(json.loads(request.content)["prompt"])
        if len(calls) % 2 == 0:
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=sse(text_chunk("x"), text_chunk("y"), USAGE))

    convs = [Conversation(i, (Turn(f"p{i}", 1, 4),), chat=False) for i in range(6)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await run_load(convs, StreamClient(EndpointConfig("http://s"), http),
                                  LoadConfig(max_concurrency=2, num_prompts=6))

    result = asyncio.run(go())
    assert len(result.records) == 6 and sorted(calls) == [f"p{i}" for i in range(6)]
    assert sum(r.success for r in result.records) == 3


def test_multi_turn_resends_history_with_the_received_reply():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(chat_chunk(f"reply{len(bodies)}")))

    conv = Conversation(0, (Turn("q1", 1, 4), Turn("q2", 1, 4), Turn("q3", 1, 4)), chat=True)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await run_load([conv], StreamClient(EndpointConfig("http://s"), http), LoadConfig(num_prompts=3))

    result = asyncio.run(go())
    assert [r.turn for r in result.records] == [0, 1, 2]
    assert bodies[2]["messages"] == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "reply1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "reply2"},
        {"role": "user", "content": "q3"},
    ]
    # the client-side context estimate grows by each turn and each reply
    assert [r.input_tokens for r in result.records] == [1, 3, 5]


def test_concurrency_cap_bounds_requests_in_flight():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return httpx.Response(200, content=sse(text_chunk("x")))

    convs = [Conversation(i, (Turn("p", 1, 1),), chat=False) for i in range(12)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await run_load(convs, StreamClient(EndpointConfig("http://s"), http),
                                  LoadConfig(max_concurrency=3, num_prompts=12))

    assert len(asyncio.run(go()).records) == 12
    assert state["peak"] == 3


def test_duration_run_stops_issuing_at_the_deadline():
    def handler(request):
        return httpx.Response(200, content=sse(text_chunk("x")))

    convs = (Conversation(i, (Turn("p", 1, 1),), chat=False) for i in range(10_000))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await run_load(convs, StreamClient(EndpointConfig("http://s"), http),
                                  LoadConfig(request_rate=50.0, num_prompts=None, duration_s=0.4, seed=2))

    result = asyncio.run(go())
    # Poisson at 50/s for 0.4 s: about 20 arrivals, never the whole budget
    assert 5 <= len(result.records) <= 45
    assert max(r.start_s for r in result.records) < 0.4 + 0.05


@pytest.mark.parametrize("kwargs", [dict(num_prompts=None), dict(num_prompts=5, duration_s=1.0),
                                    dict(max_concurrency=0), dict(request_rate=0.0)])
def test_load_config_rejects_contradictory_settings(kwargs):
    with pytest.raises(ValueError):
        LoadConfig(**kwargs)
