"""/metrics, /v1/cluster and /openapi.json say what the server is and does."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orchard.cluster.coordinator.router import NoNodeAvailable
from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.conftest import API_KEY, KeepEngine
from tests.gateway.live_server import LiveServer

DESIGN_NAMES = [
    "orchard_prefix_cache_hit_tokens_total", "orchard_prefix_cache_query_tokens_total", "orchard_kv_blocks_used",
    "orchard_kv_blocks_total", "orchard_kv_migrated_blocks_total", "orchard_preemptions_total",
    "orchard_time_to_first_token_seconds", "orchard_inter_token_latency_seconds", "orchard_requests_total",
]


def samples(http) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_expose_every_design_name_and_count_each_request(http, client, model_name):
    before = samples(http)
    client.completions.create(model=model_name, prompt="count me", max_tokens=4, temperature=0)
    after = samples(http)
    names = {name for name, _ in after}
    for name in DESIGN_NAMES:
        assert any(n.startswith(name) for n in names), name
    assert after[("orchard_kv_blocks_total", (("node", "local"),))] > 0
    key = ("orchard_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[key] - before.get(key, 0.0) == 1
    ttft = ("orchard_time_to_first_token_seconds_count", (("node", "local"),))
    assert after[ttft] - before.get(ttft, 0.0) == 1


def test_cluster_view_reports_the_engine_pool(http, engine, model_name):
    info = http.get("/v1/cluster").json()
    assert info["model"] == model_name
    assert [n["node"] for n in info["nodes"]] == ["local"]
    assert info["kv_blocks_total"] == info["nodes"][0]["kv_blocks_total"] == engine.stats()["kv"]["blocks_total"]
    assert 0.0 <= info["prefix_cache_hit_rate"] <= 1.0


def test_repeated_prompt_shows_prefix_cache_hits(http, client, model_name):
    prompt = "a shared prefix that spans more than one whole block of tokens, " * 3
    before = http.get("/v1/cluster").json()["nodes"][0]
    for _ in range(2):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    after = http.get("/v1/cluster").json()["nodes"][0]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]


def test_openapi_declares_400_not_422_and_the_stream_media_type(http):
    spec = http.get("/openapi.json").json()
    assert all("422" not in op["responses"] for item in spec["paths"].values() for op in item.values())
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "413", "429", "503", "504"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "ChatCompletionChunk" in spec["components"]["schemas"]
    assert "securitySchemes" not in spec.get("components", {})


def test_openapi_declares_bearer_auth_when_keys_are_set(engine):
    with LiveServer(create_app(KeepEngine(engine), GatewayConfig(api_keys=frozenset({API_KEY})))) as live:
        spec = httpx.get(live.url + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "401" in spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]


class NoRoute(KeepEngine):
    """A cluster that knows the model but has no node to route to."""

    async def generate(self, request_id, model, prompt_token_ids, params, session=None):
        raise NoNodeAvailable(model)
        yield  # pragma: no cover  (makes this an async generator)


def test_stream_refused_before_its_first_token_gets_a_real_status(engine, model_name):
    with LiveServer(create_app(NoRoute(engine), GatewayConfig())) as live:
        body = {"model": model_name, "prompt": "hi", "stream": True}
        r = httpx.post(live.url + "/v1/completions", json=body)
        plain = httpx.post(live.url + "/v1/completions", json={**body, "stream": False})
    for response in (r, plain):
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_node_ready"
