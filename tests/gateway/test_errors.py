"""Every refusal has OpenAI's error shape and the status OpenAI would give."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.conftest import API_KEY, KeepEngine, serve
from tests.gateway.live_server import LiveServer


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 2.5), ("top_p", 0), ("n", 0), ("max_tokens", 0), ("presence_penalty", 3), ("logprobs", 21), ("stop", [""]), ("prompt", [])],
)
def test_out_of_range_parameter_is_400_naming_it(http, model_name, field, value):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 2, field: value}
    assert_error(http.post("/v1/completions", json=body), 400, field)


def test_unknown_parameter_is_400_naming_it(http, model_name):
    err = assert_error(http.post("/v1/completions", json={"model": model_name, "prompt": "hi", "beam_width": 2}), 400, "beam_width")
    assert "beam_width" in err["message"]


def test_chat_message_with_bad_role_is_400_on_messages(http, model_name):
    body = {"model": model_name, "messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "messages")


def test_top_logprobs_without_logprobs_is_400(http, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "top_logprobs")


def test_stream_options_without_stream_is_400(http, model_name):
    body = {"model": model_name, "prompt": "hi", "stream_options": {"include_usage": True}}
    assert_error(http.post("/v1/completions", json=body), 400, "stream_options")


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_missing_required_field_is_400_naming_it(http):
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400, "model")


def test_token_id_outside_the_vocabulary_is_400(http, model_name):
    assert_error(http.post("/v1/completions", json={"model": model_name, "prompt": [1, 10**9]}), 400, "prompt")


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"}), 404, "model", "model_not_found")
    assert "no-such-model" in err["message"]


def test_prompt_longer_than_the_context_is_400_stating_both_lengths(http, model_name, engine):
    ids = [5] * (engine.max_model_len + 3)
    err = assert_error(http.post("/v1/completions", json={"model": model_name, "prompt": ids}), 400, "prompt", "context_length_exceeded")
    assert str(engine.max_model_len) in err["message"] and str(len(ids)) in err["message"]


def test_prompt_plus_max_tokens_beyond_the_context_is_400(http, model_name, engine):
    body = {"model": model_name, "prompt": [5, 6, 7], "max_tokens": engine.max_model_len}
    err = assert_error(http.post("/v1/completions", json=body), 400, "prompt", "context_length_exceeded")
    assert str(engine.max_model_len) in err["message"] and "3 in the prompt" in err["message"]


def test_unknown_route_is_404_in_openai_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_wrong_method_is_405_in_openai_shape(http):
    assert_error(http.get("/v1/completions"), 405)


def test_full_queue_is_429_with_retry_after(engine, model_name):
    with serve(engine, max_queue=0, retry_after_s=3) as live:
        r = httpx.post(live.url + "/v1/completions", json={"model": model_name, "prompt": "hi"})
    assert_error(r, 429, None, "queue_full")
    assert r.headers["retry-after"] == "3"


class NotReady(KeepEngine):
    async def ready(self) -> bool:
        return False


def test_no_node_ready_is_503_and_health_says_so(engine, model_name):
    with LiveServer(create_app(NotReady(engine), GatewayConfig())) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": model_name, "messages": [{"role": "user", "content": "x"}]})
        health = httpx.get(live.url + "/health")
        cluster = httpx.get(live.url + "/v1/cluster")
        metrics = httpx.get(live.url + "/metrics")
    assert_error(r, 503, None, "no_node_ready")
    assert_error(cluster, 503, None, "no_node_ready")
    assert health.status_code == 503 and health.json() == {"status": "starting"}
    assert metrics.status_code == 200 and "orchard_requests_total" in metrics.text


def test_health_is_200_when_ready(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.fixture(scope="module")
def keyed(engine):
    with serve(engine, api_keys=frozenset({API_KEY})) as live:
        yield live


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_missing_or_wrong_api_key_is_401(keyed, model_name, headers):
    r = httpx.post(keyed.url + "/v1/completions", json={"model": model_name, "prompt": "hi"}, headers=headers)
    assert_error(r, 401, None, "invalid_api_key")
    assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 401


def test_right_api_key_is_served(keyed, model_name):
    import openai

    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key


def test_bad_requests_do_not_disturb_a_running_stream(server, client, model_name):
    reference = client.completions.create(model=model_name, prompt="steady", max_tokens=24, temperature=0).choices[0].text
    texts: list[str] = []

    def stream():
        chunks = client.completions.create(model=model_name, prompt="steady", max_tokens=24, temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in chunks))

    worker = threading.Thread(target=stream)
    worker.start()
    statuses = set()
    with httpx.Client(base_url=server.url) as http:
        for body in ({"model": model_name, "prompt": [10**9]}, {"model": model_name}, {"prompt": "x"}, {"model": model_name, "prompt": "x", "n": 10**6}):
            statuses.add(http.post("/v1/completions", json=body).status_code)
    worker.join(60)
    assert statuses == {400}
    assert texts == [reference]


def test_lone_surrogate_in_chat_content_is_400_on_messages(http, model_name):
    body = json.dumps({"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi \ud800"}]})
    assert "\\ud800" in body  # JSON's escape for a lone surrogate, as a client sends it
    raw = body
    r = http.post("/v1/chat/completions", content=raw.encode(), headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, "messages")
    assert "Unicode" in err["message"]


@pytest.mark.parametrize(
    "endpoint, field, value",
    [
        ("/v1/chat/completions", "stream", "yes"),
        ("/v1/chat/completions", "logprobs", 1),
        ("/v1/completions", "stream", 1),
        ("/v1/completions", "n", "2"),
        ("/v1/completions", "max_tokens", 2.0),
        ("/v1/completions", "temperature", "0.5"),
        ("/v1/completions", "ignore_eos", "false"),
        ("/v1/completions", "seed", True),
    ],
)
def test_numbers_and_booleans_are_strict(http, model_name, endpoint, field, value):
    body = {"model": model_name, "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint else {"prompt": "hi"})
    assert_error(http.post(endpoint, json=body), 400, field)


def test_an_integer_still_counts_where_a_float_is_asked_for(client, model_name):
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=0, top_p=1, presence_penalty=0)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("key", ["Zq9-tiny", "fifteen-chars-x"])
def test_api_keys_shorter_than_16_characters_are_refused_at_start(engine, key):
    from orchard.cluster.gateway.guard import WeakApiKey

    with pytest.raises(WeakApiKey, match="shorter than 16 characters") as refused:
        create_app(KeepEngine(engine), GatewayConfig(api_keys=frozenset({key, API_KEY})))
    assert key not in str(refused.value)  # the message does not repeat a secret


def test_head_refuses_a_short_api_key_with_a_clear_message(capsys):
    from orchard.cluster.cli.main import main

    assert main(["head", "--bind", "127.0.0.1", "--no-advertise", "--api-key", "abc123"]) == 2
    assert "shorter than 16 characters" in capsys.readouterr().err


def test_serve_refuses_a_short_api_key_before_starting_anything(capsys):
    from orchard.cluster.cli.main import main

    assert main(["serve", "--no-ray", "--port", "0", "--api-key", "abc123"]) == 2
    assert "shorter than 16 characters" in capsys.readouterr().err


def test_dashboard_forbids_framing_foreign_code_and_referers(http):
    for path in ("/dashboard", "/dashboard/dashboard.js"):
        r = http.get(path)
        assert r.status_code == 200
        csp = r.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["Referrer-Policy"] == "no-referrer"
