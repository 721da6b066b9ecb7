"""Requests end when their client leaves or their time runs out, and free their KV at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.conftest import KeepEngine
from tests.gateway.live_server import LiveServer

LONG = 200  # tokens: far more than a test waits for


def cluster(url: str) -> dict:
    return httpx.get(url + "/v1/cluster").json()


def aborted(engine) -> int:
    return int(engine.stats().get("aborted_requests", 0))


def wait_until(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
    return time.monotonic() - start


def long_budget(engine) -> int:
    return min(LONG, engine.max_model_len - 8)


def test_disconnect_mid_stream_aborts_and_frees_its_blocks(server, engine, model_name):
    before = aborted(engine)
    body = {"model": model_name, "prompt": "a long story", "max_tokens": long_budget(engine), "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # held: dropping the iterator would close the connection here
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        assert cluster(server.url)["kv_blocks_used"] > 0
    waited = wait_until(lambda: cluster(server.url)["kv_blocks_used"] == 0)
    assert waited < 2.0
    wait_until(lambda: aborted(engine) == before + 1)


class PausedAfterFirstOutput(KeepEngine):
    """Holds a request's stream for a second after its first output, so that the stream is sure to
    outlast the gateway's 0.2 s timeout or a 0.3 s grace however fast the engine generates here."""

    async def generate(self, *args, **kwargs):
        first = True
        async for output in super().generate(*args, **kwargs):
            yield output
            if first:
                first = False
                await asyncio.sleep(1.0)


@contextlib.contextmanager
def slowed_steps(engine, seconds: float):
    """Every engine step takes `seconds` longer while this holds: an answer of LONG tokens then
    outlasts a client's 0.3 s read timeout however fast the engine generates here (the engine
    runs ahead of any pause in the gateway's stream, and a finished request has nothing to abort)."""
    inner = engine.engine
    step = inner.step

    def slow_step():
        time.sleep(seconds)
        return step()

    inner.step = slow_step
    try:
        yield
    finally:
        del inner.step


def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(server, engine, model_name):
    before = aborted(engine)
    body = {"model": model_name, "prompt": "a long story", "max_tokens": long_budget(engine), "temperature": 0}
    with slowed_steps(engine, 0.01), pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_until(lambda: aborted(engine) == before + 1, 2.0)
    wait_until(lambda: cluster(server.url)["kv_blocks_used"] == 0, 2.0)


@pytest.fixture(scope="module")
def impatient(engine):
    with LiveServer(create_app(PausedAfterFirstOutput(engine), GatewayConfig(request_timeout_s=0.2))) as live:
        yield live


def test_request_past_the_timeout_is_504_not_to_be_retried_and_aborted(impatient, engine, model_name):
    before = aborted(engine)
    body = {"model": model_name, "prompt": "a long story", "max_tokens": long_budget(engine), "temperature": 0}
    r = httpx.post(impatient.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert r.headers["x-should-retry"] == "false"
    wait_until(lambda: aborted(engine) == before + 1, 2.0)


def test_the_openai_client_sends_a_timed_out_request_once(impatient, engine, model_name):
    sent: list[str] = []
    http_client = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url.path)]})
    client = openai.OpenAI(base_url=impatient.url + "/v1", api_key="unused", max_retries=2, timeout=30, http_client=http_client)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=model_name, prompt="a long story", max_tokens=long_budget(engine), temperature=0)
    assert refused.value.status_code == 504
    assert sent == ["/v1/completions"]


def test_stream_past_the_timeout_ends_with_an_error_event(impatient, engine, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "go"}], "max_tokens": long_budget(engine) // 2, "stream": True, "temperature": 0}
    with httpx.stream("POST", impatient.url + "/v1/chat/completions", json=body, timeout=30) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "request_timeout"
    wait_until(lambda: cluster(impatient.url)["kv_blocks_used"] == 0, 2.0)


def test_64_concurrent_streams_all_complete_with_their_greedy_text(server, client, model_name):
    prompts = [f"client number {i % 4}" for i in range(64)]
    reference = {p: client.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in set(prompts)}

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def all_of_them():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == [reference[p] for p in prompts]
    assert all(finish in ("stop", "length") for _, finish in results)


class RecordsShutdown(KeepEngine):
    shut_down_at: float | None = None

    async def shutdown(self) -> None:
        self.shut_down_at = time.monotonic()
        await super().shutdown()


def test_shutdown_lets_an_inflight_stream_finish_then_stops_the_backend(engine, model_name):
    backend = RecordsShutdown(engine)
    live = LiveServer(create_app(backend, GatewayConfig()), graceful_s=30)
    body = {"model": model_name, "prompt": "finish me", "max_tokens": 24, "temperature": 0, "stream": True}
    with live:
        expected = httpx.post(live.url + "/v1/completions", json={**body, "stream": False}).json()["choices"][0]["text"]
        data: list[str] = []
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            data.append(next(lines))
            stopper = threading.Thread(target=live.__exit__, args=(None, None, None))
            stopper.start()  # what SIGTERM does: stop accepting, drain, then lifespan shutdown
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):
                httpx.get(live.url + "/health", timeout=2)
            data.extend(lines)
            finished_at = time.monotonic()
        stopper.join(30)
    events = [d[6:] for d in data if d.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    assert backend.shut_down_at is not None and backend.shut_down_at >= finished_at - 0.5


def test_streams_still_running_when_the_grace_ends_close_with_an_error_and_done(engine, model_name):
    live = LiveServer(create_app(PausedAfterFirstOutput(engine), GatewayConfig()), graceful_s=0.3)
    body = {"model": model_name, "prompt": "a long story", "max_tokens": long_budget(engine), "temperature": 0,
            "ignore_eos": True, "stream": True}
    with live:
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            data = [next(lines)]
            stopper = threading.Thread(target=live.__exit__, args=(None, None, None))
            stopper.start()  # SIGTERM: drain for graceful_s, then cut what still runs
            data.extend(lines)
        stopper.join(30)
    events = [d[6:] for d in data if d.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 0 < len(texts) < long_budget(engine)
