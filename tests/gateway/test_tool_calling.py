"""Tool calls and reasoning through a live gateway and the openai SDK, on scripted answers.

Two servers share the demo tokenizer: one without a chat template (ChatML, which lays
tools out the Hermes way), one with a small template that renders tools and opens a think
block when asked to (`chat_template_kwargs`), read by the hermes and qwen3 parsers it implies.
"""

from __future__ import annotations

import json

import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer
from tests.gateway.scripted import MODEL, ScriptedBackend, demo_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
    "{# answers end with </think> and <tool_call> blocks #}"
)


def _server(template: str | None):
    backend = ScriptedBackend(demo_tokenizer(template))
    live = LiveServer(create_app(backend, GatewayConfig(request_timeout_s=30.0)))
    return backend, live


@pytest.fixture(scope="module")
def chatml():
    backend, live = _server(None)
    with live:
        yield backend, openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def thinking():
    backend, live = _server(THINKING_TEMPLATE)
    with live:
        yield backend, openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), max_tokens=200, **kw)


def test_a_tool_call_in_the_answer_comes_back_as_tool_calls(chatml):
    backend, client = chatml
    backend.script = "I will check." + CALL
    out = ask(client, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}


def test_streamed_tool_call_deltas_have_openais_shape_and_add_up(chatml):
    backend, client = chatml
    backend.script = "I will check." + CALL + TIME_CALL
    chunks = list(ask(client, tools=TOOLS, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    firsts = {}
    for piece in pieces:
        if piece.index not in firsts:
            firsts[piece.index] = piece
            assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
        else:
            assert piece.id is None and piece.type is None and piece.function.name is None
    assert [firsts[i].function.name for i in sorted(firsts)] == ["get_weather", "get_time"]
    arguments = {i: "".join(p.function.arguments or "" for p in pieces if p.index == i) for i in firsts}
    assert json.loads(arguments[0]) == {"city": "Paris", "unit": "c"} and json.loads(arguments[1]) == {}
    assert len([p for p in pieces if p.index == 0]) > 2  # the arguments arrive in pieces, as written
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "I will check."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_the_sdks_stream_helper_assembles_the_calls(chatml):
    backend, client = chatml
    backend.script = CALL + TIME_CALL
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    assert not final.choices[0].message.content


def test_parallel_tool_calls_false_keeps_one_call(chatml):
    backend, client = chatml
    backend.script = CALL + TIME_CALL
    assert len(ask(client, tools=TOOLS).choices[0].message.tool_calls) == 2
    assert [c.function.name for c in ask(client, tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls] == ["get_weather"]
    streamed = list(ask(client, tools=TOOLS, parallel_tool_calls=False, stream=True))
    assert {tc.index for c in streamed for tc in (c.choices[0].delta.tool_calls or [])} == {0}


def test_tool_choice_none_offers_no_tools_and_parses_no_calls(chatml):
    backend, client = chatml
    backend.script = CALL
    plain = ask(client)
    none = ask(client, tools=TOOLS, tool_choice="none")
    offered = ask(client, tools=TOOLS)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL
    assert none.choices[0].finish_reason == "stop"


def test_a_malformed_call_or_none_at_all_is_content(chatml):
    backend, client = chatml
    for script in ("just words", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'):
        backend.script = script
        choice = ask(client, tools=TOOLS).choices[0]
        assert choice.message.content == script and choice.message.tool_calls is None
        assert choice.finish_reason == "stop"


def test_a_tool_round_trip_reaches_the_prompt(chatml):
    backend, client = chatml
    backend.script = "It is sunny."
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = ask(client, tools=TOOLS, messages=messages)
    assert out.choices[0].message.content == "It is sunny."
    prompt = backend.tokenizer.decode(backend.prompts[-1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools, listed in the system turn


def test_tool_turns_and_tools_are_checked(chatml):
    _, client = chatml
    bad = [
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}, "messages"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, **kw)
        assert err.value.body["param"] == param, kw


def test_tools_reach_the_models_template(thinking):
    backend, client = thinking
    backend.script = "ok"
    ask(client, tools=TOOLS)
    assert "TOOLS: get_weather get_time" in backend.tokenizer.decode(backend.prompts[-1])


def test_reasoning_goes_to_reasoning_content_when_the_template_thinks(thinking):
    backend, client = thinking
    backend.script = "Paris is in France.\nIt is warm.\n</think>\n\nSunny."
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    message = ask(client, extra_body=think).choices[0].message
    assert message.reasoning_content == "Paris is in France.\nIt is warm."
    assert message.content == "Sunny."
    chunks = list(ask(client, extra_body=think, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sunny."
    off = ask(client).choices[0].message  # no think block opened: all of it is the answer
    assert getattr(off, "reasoning_content", None) is None and off.content == backend.script


def test_reasoning_then_a_tool_call(thinking):
    backend, client = thinking
    backend.script = "I need the weather.</think>" + CALL
    message = ask(client, tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert message.reasoning_content == "I need the weather."
    assert message.tool_calls[0].function.name == "get_weather" and message.content is None


@pytest.mark.parametrize(("choice", "script", "names"), [
    ({"type": "function", "function": {"name": "get_time"}}, "{}", ["get_time"]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', ["get_weather"]),
])
def test_forced_tool_choice_answers_are_read_unwrapped_as_calls(chatml, choice, script, names):
    """The engine holds a forced answer to the call's JSON (test_forced_tool_calls shows it on a real
    model); here the script stands in for it: the unwrapped answer is the call."""
    backend, client = chatml
    backend.script = script
    choice_out = ask(client, tools=TOOLS, tool_choice=choice).choices[0]
    assert [c.function.name for c in choice_out.message.tool_calls] == names
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    streamed = list(ask(client, tools=TOOLS, tool_choice=choice, stream=True))
    assert [tc.function.name for c in streamed for tc in (c.choices[0].delta.tool_calls or []) if tc.id] == names


def test_a_langchain_agent_completes_a_tool_round_trip(chatml):
    """A framework client from a registry: LangChain's ChatOpenAI binds a tool, gets the call
    (whole and streamed), runs the tool, and answers from its result."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    backend, client = chatml
    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="none", max_retries=0).bind_tools([get_weather])
    backend.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ask_weather = HumanMessage("weather in Paris?")
    ai = llm.invoke([ask_weather])
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    streamed = None
    for piece in llm.stream([ask_weather]):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = get_weather.invoke(ai.tool_calls[0])
    backend.script = "It is sunny in Paris."
    final = llm.invoke([ask_weather, ai, result])
    assert final.content == "It is sunny in Paris." and not final.tool_calls
    assert "sunny in Paris" in backend.tokenizer.decode(backend.prompts[-1])
