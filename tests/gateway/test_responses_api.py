"""OpenAI's Responses API through the openai SDK, on scripted answers (the thinking
template of test_tool_calling): output items, function calls, previous_response_id, streams."""

from __future__ import annotations

import json

import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.responses_api import ResponseStore
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer
from tests.gateway.scripted import MODEL, ScriptedBackend, demo_tokenizer
from tests.gateway.test_tool_calling import CALL, THINKING_TEMPLATE

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(demo_tokenizer(THINKING_TEMPLATE))
    with LiveServer(create_app(backend, GatewayConfig(request_timeout_s=30.0))) as live:
        yield backend, openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def test_a_text_answer_is_one_message_item(served):
    backend, client = served
    backend.script = "Sunny."
    out = client.responses.create(model=MODEL, input="weather?", instructions="be brief", max_output_tokens=50)
    assert out.status == "completed" and out.output_text == "Sunny."
    assert [i.type for i in out.output] == ["message"]
    assert out.usage.input_tokens == len(backend.prompts[-1]) and out.usage.output_tokens > 0
    assert "be brief" in backend.tokenizer.decode(backend.prompts[-1])


def test_function_calls_and_reasoning_are_output_items(served):
    backend, client = served
    backend.script = "Need data.</think>" + CALL
    out = client.responses.create(model=MODEL, input="weather in Paris?", tools=TOOLS, max_output_tokens=200,
                                  reasoning={"effort": "low"})
    assert [i.type for i in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text == "Need data."
    call = out.output[-1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert call.call_id.startswith("call_")


def test_previous_response_id_continues_the_conversation(served):
    backend, client = served
    backend.script = CALL
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=TOOLS)
    call = first.output[-1]
    backend.script = "It is sunny in Paris."
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.output_text == "It is sunny in Paris."
    prompt = backend.tokenizer.decode(backend.prompts[-1])
    assert "weather in Paris?" in prompt and "<tool_call>get_weather" in prompt and "sunny, 21 C" in prompt
    assert client.responses.retrieve(second.id).output_text == "It is sunny in Paris."
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")


def test_a_streamed_response_has_the_typed_events_and_the_same_items(served):
    backend, client = served
    backend.script = "Let me look." + CALL
    events = list(client.responses.create(model=MODEL, input="weather?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Let me look." and json.loads(arguments) == {"city": "Paris", "unit": "c"}
    final = events[-1].response
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == arguments and final.output_text == "Let me look."


def test_a_cut_answer_is_incomplete_and_unsupported_fields_are_400(served):
    backend, client = served
    backend.script = "a long answer that goes on and on"
    out = client.responses.create(model=MODEL, input="go on", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    for field in ({"background": True}, {"conversation": "conv_1"}, {"frobnicate": 1}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="hi", extra_body=field)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])


def test_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid}, [])
    assert store.get("a") is None and store.get("c") == ({"id": "c"}, [])
    now[0] = 11.0
    assert store.get("c") is None
