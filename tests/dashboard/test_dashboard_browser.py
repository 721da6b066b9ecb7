"""The dashboard in headless Chromium against a live `orchard serve --nodes 2` that needs a key.

The page gets the key once through `?key=`, shows one row per node, and after a
completion shows it: the request counter moves and the routing decision for that request
appears with its reason. Its charts (uPlot, from /v1/cluster/history) draw the nodes'
generated tokens, TTFT, KV use per node, hit rate and errors, and the routing picture shows
which node served the two requests' shared prefix. A screenshot goes to
test-artifacts/dashboard.png for a person to see (docs/img/dashboard.png is a copy of one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from tests.dashboard.browser import Chromium, find_chromium

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CHROMIUM = find_chromium()
ORCHARD = Path(sys.executable).with_name("orchard")
# For a person to look at after a run; docs/img/dashboard.png is a copy of one such screenshot.
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard.png"
KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHARED_PREFIX = "the orchard keeps its prefix blocks where the last request left them " * 3

if CHROMIUM is None:
    pytest.skip("no Chromium here (Debian: apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def served():
    cmd = [str(ORCHARD), "serve", "--nodes", "2", "--port", "0", "--api-key", KEY, "--max-model-len", "256",
           "--kv-memory", "0.05", "--grace", "5"]
    # The server's logs go to a file: a pipe nobody drains fills up and blocks the server.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        line = proc.stdout.readline()
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        if not re.search(r"serving (\S+) at (http://\S+)/v1", line):
            proc.wait(timeout=5) if proc.poll() is None else None
            log.seek(0)
            pytest.fail(f"orchard serve did not start: {line!r}\n{log.read()[-3000:]}")
        match = re.search(r"serving (\S+) at (http://\S+)/v1", line)
        yield match.group(1), match.group(2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


ROWS = "document.querySelectorAll('#nodes tbody tr').length"
NODE_IDS = "[...document.querySelectorAll('#nodes tbody tr')].map(r => r.dataset.node).sort()"
REQUESTS = "Number(document.getElementById('sum-requests').textContent.replace(/,/g, ''))"
NODE_REQUESTS = ("[...document.querySelectorAll('#nodes tbody td.requests')]"
                 ".reduce((sum, td) => sum + (Number(td.textContent) || 0), 0)")
CHART_POINTS = "Object.fromEntries([...document.querySelectorAll('.chart')].map(c => [c.id, Number(c.dataset.points || 0)]))"
CHART_CANVASES = "[...document.querySelectorAll('.chart')].every(c => c.querySelector('canvas') !== null)"
GENERATED_DRAWN = "orchardCharts['chart-throughput'].plot.data.slice(1).some(s => s.some(v => v > 0))"
TTFT_DRAWN = "orchardCharts['chart-ttft'].plot.data[1].some(v => v > 0)"
KV_SERIES = "orchardCharts['chart-kv'].plot.series.slice(1).map(s => s.label).sort()"
PREFIX_ROWS = ("[...document.querySelectorAll('#prefixes tbody tr')]"
               ".map(r => [r.cells[0].textContent, r.cells[1].textContent, r.cells[3].textContent])")
DECISIONS = ("[...document.querySelectorAll('#decisions tbody tr')]"
             ".map(r => [r.cells[1].textContent, r.cells[2].textContent, r.cells[3].textContent])")


def test_dashboard_shows_both_nodes_and_updates_after_a_request(served):
    model, url = served
    nodes = sorted(n["node"] for n in httpx.get(url + "/v1/cluster", headers=AUTH, timeout=30).json()["nodes"])
    assert len(nodes) == 2
    with Chromium(CHROMIUM) as page:
        page.open(f"{url}/dashboard?key={KEY}&every=400", height=1250)
        page.wait_for(f"document.body.dataset.state === 'live' && {ROWS} === 2", timeout_s=90)
        assert page.evaluate(NODE_IDS) == nodes
        assert page.evaluate("location.search") == "?every=400"  # the key left the address bar
        assert page.evaluate("sessionStorage.getItem('orchard-api-key')") == KEY
        before = page.evaluate(REQUESTS)

        request_id = complete(url, model, SHARED_PREFIX + "first")
        page.wait_for(f"{REQUESTS} === {before + 1}", timeout_s=60)
        decisions = page.wait_for(
            f"{DECISIONS}.filter(d => d[0].startsWith('{request_id}'))", timeout_s=60)
        assert len(decisions) == 1
        assert decisions[0][1] in nodes
        assert decisions[0][2] in ("prefix-hit", "load", "migrate")

        complete(url, model, SHARED_PREFIX + "second")
        page.wait_for(f"{REQUESTS} === {before + 2}", timeout_s=60)
        # The node table follows the nodes' heartbeats: warm-up plus the two completions.
        page.wait_for(f"{NODE_REQUESTS} === 3", timeout_s=30)
        assert page.evaluate(ROWS) == 2
        check_charts(page, nodes)
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        assert page.screenshot(str(SCREENSHOT)) > 10_000
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_charts(page, nodes: list[str]) -> None:
    """Every chart drew sampled points; the engines' tokens, a TTFT and one KV line per node among them."""
    page.wait_for(f"{GENERATED_DRAWN} && {TTFT_DRAWN}", timeout_s=30)
    page.wait_for(f"Object.values({CHART_POINTS}).every(n => n >= 3)", timeout_s=30)
    assert page.evaluate(CHART_CANVASES)
    assert page.evaluate(KV_SERIES) == nodes
    # Both completions start with the same blocks: one prefix, served twice, by the nodes shown.
    rows = page.wait_for(f"{PREFIX_ROWS}.filter(r => r[1].match(/× /g) && "
                         "r[1].split(', ').reduce((n, s) => n + Number(s.split(' × ')[1]), 0) >= 2)", timeout_s=30)
    served = dict(part.split(" × ") for part in rows[0][1].split(", "))
    assert set(served) <= set(nodes) and sum(map(int, served.values())) >= 2
    assert rows[0][2] in ("prefix-hit", "load", "migrate")


def test_dashboard_without_a_key_asks_for_one(served):
    _, url = served
    with Chromium(CHROMIUM) as page:
        page.open(f"{url}/dashboard")
        page.wait_for("document.body.dataset.state === 'needs-key'", timeout_s=60)
        assert page.evaluate("document.getElementById('key-form').hidden") is False
        assert page.evaluate(ROWS) == 0


def test_metrics_over_ray_label_each_node_and_count_routing_reasons(served):
    """The same server's /metrics: vLLM's per-node families name both nodes, and the
    coordinator's decisions (warm-up and the two completions above) are counted by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    _, url = served
    nodes = sorted(n["node"] for n in httpx.get(url + "/v1/cluster", headers=AUTH, timeout=30).json()["nodes"])
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    assert sorted(s.labels["node"] for s in families["vllm:kv_cache_usage_perc"].samples) == nodes
    routed = [s for s in families["orchard_routing_decisions"].samples if s.name.endswith("_total")]
    assert {s.labels["node"] for s in routed} <= set(nodes)
    assert {s.labels["reason"] for s in routed} <= {"prefix-hit", "load", "migrate", "only-node"}
    assert sum(s.value for s in routed) >= 2
