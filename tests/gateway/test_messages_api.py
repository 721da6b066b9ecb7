"""Anthropic's Messages API through the official anthropic SDK, on scripted answers (the
thinking template of test_tool_calling, so reasoning and tool calls are both in play)."""

from __future__ import annotations

import anthropic
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer
from tests.gateway.scripted import MODEL, ScriptedBackend, demo_tokenizer
from tests.gateway.test_tool_calling import CALL, THINKING_TEMPLATE

TOOLS = [{"name": "get_weather", "description": "weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
KEY = "messages-test-key-0123"


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(demo_tokenizer(THINKING_TEMPLATE))
    with LiveServer(create_app(backend, GatewayConfig(request_timeout_s=30.0, api_keys=frozenset({KEY})))) as live:
        yield backend, anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0), live.url


def test_a_text_answer_is_one_text_block(served):
    backend, client, _ = served
    backend.script = "Sunny and warm."
    out = client.messages.create(model=MODEL, max_tokens=100, system="be brief", messages=ASK)
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == "Sunny and warm."
    assert out.stop_reason == "end_turn" and out.role == "assistant" and out.id.startswith("msg_")
    assert out.usage.input_tokens == len(backend.prompts[-1]) and out.usage.output_tokens > 0
    assert "be brief" in backend.tokenizer.decode(backend.prompts[-1])


def test_a_tool_call_is_a_tool_use_block(served):
    backend, client, _ = served
    backend.script = "Checking." + CALL
    out = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS)
    assert [b.type for b in out.content] == ["text", "tool_use"]
    use = out.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "unit": "c"} and use.id.startswith("toolu_")
    assert out.stop_reason == "tool_use"


def test_streamed_thinking_and_tool_use_assemble_in_the_sdk(served):
    backend, client, _ = served
    backend.script = "I need the weather.</think>" + CALL
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "I need the weather."
    assert final.content[1].input == {"city": "Paris", "unit": "c"}
    assert final.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2


def test_streamed_text_matches_the_whole_answer(served):
    backend, client, _ = served
    backend.script = "A few words, streamed one token at a time."
    with client.messages.stream(model=MODEL, max_tokens=100, messages=ASK) as stream:
        text = "".join(stream.text_stream)
    assert text == backend.script


def test_a_tool_result_round_trip_reaches_the_prompt(served):
    backend, client, _ = served
    backend.script = "It is sunny."
    messages = [*ASK, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}]
    out = client.messages.create(model=MODEL, max_tokens=50, messages=messages, tools=TOOLS)
    assert out.content[0].text == "It is sunny."
    prompt = backend.tokenizer.decode(backend.prompts[-1])
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt and "sunny, 21 C" in prompt


def test_max_tokens_ends_with_max_tokens(served):
    backend, client, _ = served
    backend.script = "a long answer that goes on and on and on"
    assert client.messages.create(model=MODEL, max_tokens=3, messages=ASK).stop_reason == "max_tokens"


def test_count_tokens_is_the_prompt_the_model_gets(served):
    backend, client, _ = served
    backend.script = "ok"
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    out = client.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=TOOLS)
    assert counted.input_tokens == out.usage.input_tokens == len(backend.prompts[-1])


def test_errors_come_in_anthropics_shape(served):
    _, client, url = served
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, extra_body={"frobnicate": 1})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong-key-0123456789", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK)
