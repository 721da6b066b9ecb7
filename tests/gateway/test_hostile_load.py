"""The gateway under hostile load: bodies refused unread, tokenizing off the event loop, exact queue limit."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx

from tests.gateway.conftest import serve

KEY = "hostile-load-key-0123456789"


def raw_request(port: int, head: str, first_bytes: bytes, timeout: float = 5.0) -> bytes:
    """Send a request's headers and the first bytes of its body only, then read what comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + first_bytes)
        reply = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_a_request_without_the_key_gets_401_before_its_200_mb_body_is_sent(engine):
    with serve(engine, api_keys=frozenset({KEY})) as live:
        head = ("POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                f"Content-Length: {200 << 20}")
        started = time.monotonic()
        reply = raw_request(live.port, head, b'{"model": "x", "prompt": "')
        assert status_of(reply) == 401, reply[:300]
        assert time.monotonic() - started < 2.0
        malformed = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert malformed.status_code == 401 and malformed.json()["error"]["code"] == "invalid_api_key"


def test_a_body_over_the_limit_gets_413_with_or_without_content_length(engine, model_name):
    with serve(engine, max_body_bytes=1 << 20) as live:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {2 << 20}"
        reply = raw_request(live.port, head, b"{")
        assert status_of(reply) == 413, reply[:300]

        def chunks():
            yield b'{"model": "%s", "prompt": "' % model_name.encode()
            for _ in range(24):
                yield b"a" * (128 << 10)
            yield b'"}'

        r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        small = httpx.post(live.url + "/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 1})
        assert small.status_code == 200


def test_a_10_mb_prompt_does_not_stall_health(engine, model_name):
    with serve(engine) as live:
        answer = {}

        def big():
            body = {"model": model_name, "prompt": "orchard bloom " * (10_000_000 // 14), "max_tokens": 1}
            answer["r"] = httpx.post(live.url + "/v1/completions", json=body, timeout=120)

        worker = threading.Thread(target=big)
        worker.start()
        time.sleep(0.5)  # the upload is in and being tokenized
        latencies = []
        while worker.is_alive() and len(latencies) < 20:
            t0 = time.monotonic()
            assert httpx.get(live.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.1)
        worker.join()
        assert answer["r"].status_code == 400  # far beyond the context: refused after tokenizing
        assert latencies and max(latencies) < 1.0, latencies


class GatedBackend:
    """The shared engine's backend, holding every request before its first output until the gate opens."""

    def __init__(self, inner, gate: threading.Event):
        self._inner, self._gate = inner, gate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, *args):
        while not self._gate.is_set():  # set from the test's thread, so polled rather than awaited
            await asyncio.sleep(0.02)
        async for out in self._inner.generate(*args):
            yield out


def test_max_queue_is_exact_under_a_burst_and_refusals_say_when_to_retry(engine, model_name):
    from orchard.cluster.gateway.app import create_app
    from orchard.cluster.gateway.state import GatewayConfig
    from tests.gateway.conftest import KeepEngine
    from tests.gateway.live_server import LiveServer

    gate = threading.Event()
    app = create_app(GatedBackend(KeepEngine(engine), gate), GatewayConfig(max_queue=4))
    body = {"model": model_name, "prompt": "burst", "max_tokens": 2}

    async def burst(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            tasks = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(32)]
            refused = []
            while len(refused) < 28 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
                refused = [t for t in tasks if t.done() and t.result().status_code == 429]
            gate.set()
            return await asyncio.gather(*tasks)

    with LiveServer(app) as live:
        replies = asyncio.run(burst(live.url))
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200] * 4 + [429] * 28
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["code"] == "queue_full"
