"""Every field of OpenAI's chat and completions requests is accepted with effect, accepted
as documented-ignored (docs/api-fields.md), or refused with a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.test_errors import assert_error

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
IGNORED = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
           "prompt_cache_key": "conversation-7", "prompt_cache_retention": "24h"}
CHAT_IGNORED = {"prediction": {"type": "content", "content": "hi"}, "modalities": ["text"], "verbosity": "medium",
                "stream_options": None, "reasoning_effort": "low", "logit_bias": {}, "response_format": {"type": "text"},
                "parallel_tool_calls": True}


def post(http: httpx.Client, model: str, path: str, **fields) -> httpx.Response:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 2}
    return http.post(path, json={"model": model, **base, **fields})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fields_without_effect_are_accepted(http, model_name, path):
    extra = {**IGNORED, **(CHAT_IGNORED if "chat" in path else {"best_of": 1, "echo": False})}
    response = post(http, model_name, path, **extra)
    assert response.status_code == 200, response.text


CHAT_REFUSED = [
    ("logit_bias", {"50256": -100}), ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("verbosity", "low"), ("web_search_options", {}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("chat_template_kwargs", {"tokenize": True}),
]


@pytest.mark.parametrize(("field", "value"), CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_chat_fields_that_cannot_be_honoured_are_400_naming_them(http, model_name, field, value):
    assert_error(post(http, model_name, "/v1/chat/completions", **{field: value}), 400, field)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"guided_json": "[1, 2]"},
    {"response_format": {"type": "json_object"}, "guided_regex": "a"},
])
def test_malformed_constraints_are_400(http, model_name, fields):
    assert post(http, model_name, "/v1/chat/completions", **fields).status_code == 400


COMPLETION_REFUSED = [("suffix", "tail"), ("best_of", 3), ("logit_bias", {"1": 5})]


@pytest.mark.parametrize(("field", "value"), COMPLETION_REFUSED, ids=[f for f, _ in COMPLETION_REFUSED])
def test_completion_fields_that_cannot_be_honoured_are_400_naming_them(http, model_name, field, value):
    assert_error(post(http, model_name, "/v1/completions", **{field: value}), 400, field)


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
    [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
])
def test_non_text_content_is_400_on_messages(http, model_name, content):
    err = assert_error(post(http, model_name, "/v1/chat/completions", messages=[{"role": "user", "content": content}]),
                       400, "messages")
    assert "not supported" in err["message"]


def test_unknown_fields_are_still_400(http, model_name):
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert_error(post(http, model_name, path, frobnicate=1), 400, "frobnicate")


def test_echo_puts_the_prompt_before_the_completion(client, model_name):
    plain = client.completions.create(model=model_name, prompt="an orchard of", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model_name, prompt="an orchard of", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "an orchard of" + plain.choices[0].text
    streamed = client.completions.create(model=model_name, prompt="an orchard of", max_tokens=4, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_assistant_refusal_and_text_parts_are_read(client, model_name):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "please"}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert out.choices[0].message.refusal is None and out.usage.completion_tokens >= 1
