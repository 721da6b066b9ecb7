"""tool_choice `required` and a named function, enforced by constrained decoding on the
random-weight demo model at temperature 1: every call it makes is well-formed because of
the mask, not luck."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.conftest import serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client():
    """The shared engine's context is too short for a tools listing in the demo tokenizer's tokens."""
    from orchard.node.async_engine import AsyncEngine
    from orchard.node.engine import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(max_model_len=1024, num_blocks=256, max_num_seqs=8))
    try:
        with serve(engine, request_timeout_s=120.0) as live:
            yield openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        engine.shutdown()


def ask(client, **kw):
    return client.chat.completions.create(model="orchard-demo", messages=[{"role": "user", "content": "call a tool"}],
                                          tools=TOOLS, temperature=1.0, max_tokens=120, **kw)


def check(calls) -> list[str]:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


def test_a_named_tool_choice_gets_a_call_to_that_function(client):
    out = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=1).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    assert check(out.message.tool_calls) == ["get_time"]


def test_required_gets_at_least_one_valid_call_and_one_without_parallel_calls(client):
    out = ask(client, tool_choice="required", seed=2).choices[0]
    assert out.finish_reason == "tool_calls" and len(check(out.message.tool_calls)) >= 1
    single = ask(client, tool_choice="required", parallel_tool_calls=False, seed=3).choices[0]
    assert len(check(single.message.tool_calls)) == 1


def test_a_forced_call_streams_as_tool_call_deltas(client):
    chunks = list(ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=4, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    jsonschema.validate(json.loads("".join(p.function.arguments or "" for p in pieces)), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
