"""`orchard serve` with its default Ray backend: a local Ray, the coordinator, one node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.listening import listeners

ORCHARD = Path(sys.executable).with_name("orchard")


@pytest.fixture(scope="module")
def ray_served():
    proc = subprocess.Popen(
        [str(ORCHARD), "serve", "--port", "0", "--max-model-len", "256", "--kv-memory", "0.05", "--grace", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**__import__("os").environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://\S+)/v1", line)
        assert match, (line, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        yield proc, match.group(1), match.group(2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


_UNAUTHENTICATED_CLIENT = textwrap.dedent("""
    import sys
    from ray._raylet import GcsClient
    try:
        GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
        print("ADMITTED")
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux's /proc")
def test_serve_keeps_every_ray_port_on_loopback_and_refuses_a_client_without_the_token(ray_served):
    proc, _, url = ray_served
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # the gateway's socket listens by now
    found = listeners(proc.pid)
    exposed = [f"{x.process}[{x.pid}] {x.address}:{x.port}" for x in found if not x.loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    gcs = [x for x in found if x.process == "gcs_server"]
    assert gcs and any(x.process == "raylet" for x in found), [(x.process, x.port) for x in found]
    assert any(x.port == int(url.rsplit(":", 1)[1]) for x in found)  # the gateway is among what was scanned

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for listener in gcs:
        client = subprocess.run([sys.executable, "-c", _UNAUTHENTICATED_CLIENT, f"127.0.0.1:{listener.port}"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert "REFUSED" in client.stdout and "InvalidAuthToken" in client.stdout, client.stdout + client.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_served_stream_matches_the_whole_answer_and_disconnects_free_blocks(ray_served):
    proc, model, url = ray_served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    whole = client.completions.create(model=model, prompt="over ray", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="over ray", max_tokens=10, temperature=0, stream=True))
    assert streamed == whole.choices[0].text
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens >= 1

    info = httpx.get(url + "/v1/cluster").json()
    assert len(info["nodes"]) == 1 and info["model"] == model
    assert info["direct_gateway_links"] == 1  # the node's outputs came over its gateway link, not a Ray stream
    assert info["route_link"] is True  # and the routes over the coordinator's link, not Ray calls
    # Latencies carry the serving node's label, and its counters are fresh right after the requests.
    node = info["nodes"][0]["node"]
    metrics = httpx.get(url + "/metrics").text
    assert f'orchard_time_to_first_token_seconds_count{{node="{node}"}} 2.0' in metrics, metrics
    assert 'node="local"' not in metrics
    assert info["nodes"][0]["prefix_cache_query_tokens"] >= 2 * whole.usage.prompt_tokens - 1

    body = {"model": model, "prompt": "a long one", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/v1/cluster").json()["kv_blocks_used"] != 0:
        assert time.monotonic() < deadline, "blocks still held after the client left"
        time.sleep(0.1)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
