"""The dashboard's history: points derived from two snapshots, the routing picture, the route, the vendored charts."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from fastapi.testclient import TestClient

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.history import History, quantile
from orchard.cluster.gateway.metrics import GatewayMetrics
from orchard.cluster.gateway.state import GatewayConfig
from tests.dashboard.test_dashboard_routes import ScriptedBackend

STATIC = Path(__file__).resolve().parents[2] / "orchard" / "cluster" / "gateway" / "static"


def node(name: str, generated: int, hits: int, queries: int, used: int = 2, total: int = 8) -> dict:
    return {"node": name, "generated_tokens": generated, "prefix_cache_hit_tokens": hits,
            "prefix_cache_query_tokens": queries, "kv_blocks_used": used, "kv_blocks_total": total}


def decision(request_id: str, node_id: str, prefix: str, at: float, reason: str = "prefix-hit") -> dict:
    return {"request_id": request_id, "node_id": node_id, "prefix": prefix, "decided_at": at, "reason": reason,
            "cached_blocks": 1}


def test_a_point_holds_each_nodes_rates_since_the_reading_before():
    history, metrics = History(period_s=2.0), GatewayMetrics()
    history.sample({"nodes": [node("a", 100, 0, 0), node("b", 10, 5, 10)]}, [], metrics, now=1000.0)
    assert history.points == type(history.points)()  # one reading makes no point yet
    metrics.recent_ttft.extend([(1001.0, 0.1), (1001.5, 0.3), (1001.9, 0.2)])
    metrics.count_request("/v1/completions", 503)
    metrics.count_request("/v1/models", 500)  # not a generation request
    history.sample({"nodes": [node("a", 300, 0, 0, used=4), node("b", 10, 25, 30)]}, [], metrics, now=1002.0)
    (point,) = history.points
    assert point["tokens_per_s"] == {"a": 100.0, "b": 0.0}
    assert point["kv_use"] == {"a": 0.5, "b": 0.25}
    assert point["hit_rate"] == {"a": None, "b": 1.0}
    assert (point["ttft_p50"], point["ttft_p99"], point["errors"]) == (0.2, 0.3, 1)


def test_the_routing_picture_counts_each_decision_once_per_prefix_newest_first():
    history, metrics = History(), GatewayMetrics()
    first = [decision("r1", "a", "p1", 1.0, "load"), decision("r2", "a", "p1", 2.0)]
    history.sample({"nodes": []}, first, metrics, now=10.0)
    history.sample({"nodes": []}, [*first, decision("r3", "b", "p2", 3.0, "migrate")], metrics, now=12.0)
    prefixes = history.to_dict()["prefixes"]
    assert [(p["prefix"], p["served"], p["last_reason"]) for p in prefixes] == [
        ("p2", {"b": 1}, "migrate"), ("p1", {"a": 2}, "prefix-hit")]


def test_quantiles_are_nearest_rank_and_none_without_values():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([3.0, 1.0, 2.0], 0.99) == 3.0


def test_history_route_samples_on_demand_and_is_behind_the_key():
    key = "hist-key-0123456789"
    with TestClient(create_app(ScriptedBackend(), GatewayConfig(api_keys=frozenset({key})))) as http:
        assert http.get("/v1/cluster/history").status_code == 401
        body = http.get("/v1/cluster/history", headers={"Authorization": f"Bearer {key}"}).json()
    assert body == {"period_s": 2.0, "points": [], "prefixes": []}  # one reading so far


def test_vendored_chart_files_match_the_sums_recorded_beside_them():
    table = (STATIC / "VENDORED.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", table, flags=re.M)
    assert {name for name, _ in rows} == {"uPlot.iife.min.js", "uPlot.min.css"}
    for name, digest in rows:
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, name
    assert "MIT" in (STATIC / "uPlot.LICENSE").read_text()
