"""What the request guard refuses before any body is read comes in Anthropic's error shape on
/v1/messages (the anthropic SDK raises its own typed errors) and in OpenAI's elsewhere."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer
from tests.gateway.scripted import MODEL, ScriptedBackend, demo_tokenizer

KEY = "refusals-test-key-0123"
LIMIT = 4000
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(demo_tokenizer())
    backend.script = "Hi."
    config = GatewayConfig(request_timeout_s=30.0, api_keys=frozenset({KEY}), max_body_bytes=LIMIT)
    with LiveServer(create_app(backend, config)) as live:
        yield backend, live.url


def test_a_wrong_key_is_anthropics_authentication_error(served):
    _, url = served
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=url, api_key="not-the-key-0123456", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    body = refused.value.body
    assert (body["type"], body["error"]["type"]) == ("error", "authentication_error") and "x-api-key" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as chat:  # the OpenAI routes keep OpenAI's shape
        openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key-0123456", max_retries=0).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4)
    assert chat.value.body["code"] == "invalid_api_key"


def test_an_oversized_body_is_a_413_in_anthropics_shape_with_or_without_content_length(served):
    backend, url = served
    before = len(backend.prompts)
    with pytest.raises(anthropic.APIStatusError) as declared:
        anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])
    assert declared.value.status_code == 413 and declared.value.body["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the guard counts the body as it arrives
        yield b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "messages": [{"role": "user", "content": "'
        for _ in range(8):
            yield b"y" * 1000
        yield b'"}]}'
    streamed = httpx.post(f"{url}/v1/messages", content=chunks(), headers={"x-api-key": KEY, "content-type": "application/json"})
    assert streamed.status_code == 413
    assert streamed.json() == {"type": "error", "error": {"type": "request_too_large",
                                                          "message": f"The request body exceeds the server's limit of {LIMIT} bytes."}}
    assert len(backend.prompts) == before
