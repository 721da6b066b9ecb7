"""/dashboard, its assets and /v1/cluster/activity over a scripted backend (no engine, no browser)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.dashboard import gateway_totals, recent_decisions
from orchard.cluster.gateway.metrics import GatewayMetrics
from orchard.cluster.gateway.state import GatewayConfig

KEY = "dash-key-0123456789"
DECISIONS = [
    {"node_id": "a1", "reason": "prefix-hit", "cached_blocks": 3, "policy": "prefix", "num_candidates": 2,
     "request_id": "cmpl-1", "decided_at": 1.0, "migration": None, "est_cost_s": 0.01, "latency_s": 1e-5},
    {"node_id": "b2", "reason": "migrate", "cached_blocks": 0, "policy": "prefix", "num_candidates": 2,
     "request_id": "cmpl-2", "decided_at": 2.0, "est_cost_s": 0.02, "latency_s": 1e-5,
     "migration": {"source": "a1", "num_blocks": 4, "est_transfer_s": 0.001, "est_recompute_s": 0.01}},
]


class ScriptedBackend:
    """Answers the gateway's questions from fixed data; `coordinator` mimics RayBackend's view."""

    def __init__(self, coordinator: dict | None = None):
        self.coordinator = coordinator

    async def models(self):
        return []

    async def ready(self) -> bool:
        return True

    async def cluster_info(self) -> dict:
        info = {"model": "m", "nodes": [{"node": "a1"}], "kv_blocks_used": 0, "kv_blocks_total": 8,
                "prefix_cache_hit_rate": 0.0, "queue_depth": 0}
        if self.coordinator is not None:
            info["coordinator"] = self.coordinator
        return info

    async def queue_depth(self) -> int:
        return 0

    async def shutdown(self) -> None:
        pass


def client(backend, keys=frozenset()) -> TestClient:
    return TestClient(create_app(backend, GatewayConfig(api_keys=frozenset(keys))))


def test_dashboard_page_is_public_even_when_keys_are_required():
    with client(ScriptedBackend(), {KEY}) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert '<table id="nodes">' in page.text and 'src="dashboard/dashboard.js"' in page.text
        assert http.get("/v1/cluster/activity").status_code == 401


@pytest.mark.parametrize("name, media", [("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                                         ("charts.js", "text/javascript"), ("uPlot.iife.min.js", "text/javascript"),
                                         ("uPlot.min.css", "text/css")])
def test_dashboard_assets_are_served_with_their_media_type(name, media):
    with client(ScriptedBackend()) as http:
        resp = http.get(f"/dashboard/{name}")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(media)
        assert len(resp.text) > 500


def test_activity_lists_the_coordinators_recent_decisions_with_their_reason():
    coordinator = {"policy": "prefix", "recent_decisions": DECISIONS}
    with client(ScriptedBackend(coordinator), {KEY}) as http:
        body = http.get("/v1/cluster/activity", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [(d["node_id"], d["reason"]) for d in body["decisions"]] == [("a1", "prefix-hit"), ("b2", "migrate")]
    assert body["decisions"][1]["migration"]["source"] == "a1" and body["decisions"][1]["migration"]["num_blocks"] == 4
    assert body["generated_tokens"] == 0 and body["completed_requests"] == 0


def test_activity_of_a_backend_that_routes_nothing_has_no_decisions():
    with client(ScriptedBackend(coordinator=None)) as http:
        assert http.get("/v1/cluster/activity").json()["decisions"] == []


def test_recent_decisions_prefers_the_backends_own_method_and_keeps_the_newest():
    class WithMethod(ScriptedBackend):
        async def recent_decisions(self, limit):
            return [{"node_id": f"n{i}", "reason": "load"} for i in range(30)]

    got = asyncio.run(recent_decisions(WithMethod(), {}, limit=5))
    assert [d["node_id"] for d in got] == ["n25", "n26", "n27", "n28", "n29"]
    from_info = asyncio.run(recent_decisions(ScriptedBackend(), {"coordinator": {"recent_decisions": DECISIONS}}, 1))
    assert from_info == [DECISIONS[1]]


def test_gateway_totals_count_completion_tokens_and_successful_completions_only():
    metrics = GatewayMetrics()
    metrics.tokens.inc(7)
    metrics.count_request("/v1/completions", 200)
    metrics.count_request("/v1/chat/completions", 200)
    metrics.count_request("/v1/completions", 400)
    metrics.count_request("/v1/models", 200)
    assert gateway_totals(metrics.registry) == (7, 2)


def test_openapi_declares_activity_behind_the_key_and_the_page():
    with client(ScriptedBackend(), {KEY}) as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert "401" in paths["/v1/cluster/activity"]["get"]["responses"]
    assert "text/html" in paths["/dashboard"]["get"]["responses"]["200"]["content"]
