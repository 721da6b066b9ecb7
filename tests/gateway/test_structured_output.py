"""Structured output through a live `orchard serve` (overlapped engine steps) with the openai SDK.

The demo model has random weights: every output that validates does so because of the mask.
Sampling runs at temperature 1 so a lucky greedy path cannot pass for a constraint.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from orchard.cluster.gateway.structured import closed_objects

ORCHARD = Path(sys.executable).with_name("orchard")

LEAVES = [
    {"type": "string", "maxLength": 6},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "string", "enum": ["a b", "c\"d", "é"]},
]


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def varied_schemas(count: int = 50) -> list[dict]:
    """Objects of one to four leaves, some optional, some nested, some inside bounded arrays."""
    schemas, seen = [], set()
    for i in itertools.count():
        if len(schemas) == count:
            return schemas
        width = 1 + i % 4
        props = {f"k{j}": LEAVES[(i * 3 + j * 7) % len(LEAVES)] for j in range(width)}
        required = [k for j, k in enumerate(props) if (i + j) % 3 != 0] or list(props)[:1]
        schema = _obj(props, required)
        if i % 5 == 1:
            schema = _obj({"inner": schema, "id": {"type": "integer", "minimum": 0, "maximum": 999}}, ["inner", "id"])
        elif i % 5 == 3:
            schema = _obj({"list": {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}}, ["list"])
        elif i % 7 == 6:
            schema = {"type": "array", "items": LEAVES[i % len(LEAVES)], "minItems": 1, "maxItems": 3}
        if json.dumps(schema, sort_keys=True) not in seen:
            seen.add(json.dumps(schema, sort_keys=True))
            schemas.append(schema)


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(
        [str(ORCHARD), "serve", "--no-ray", "--port", "0", "--max-model-len", "1024", "--kv-memory", "0.05", "--grace", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://\S+)/v1", line)
        assert match, line + proc.stderr.read()[-3000:]
        yield match.group(1), openai.OpenAI(base_url=match.group(2) + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _chat(server, **kw):
    model, client = server
    kw.setdefault("messages", [{"role": "user", "content": "Answer in the requested format."}])
    return client.chat.completions.create(model=model, temperature=1.0, **kw)


def _all(fn, items):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, items))


def test_fifty_json_schemas_each_give_output_that_validates(server):
    schemas = varied_schemas()
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50

    def ask(item):
        i, schema = item
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": i % 2 == 0}}
        return _chat(server, response_format=fmt, max_tokens=400, seed=i).choices[0]

    for schema, choice in zip(schemas, _all(ask, enumerate(schemas))):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    free = _chat(server, max_tokens=40, seed=0).choices[0].message.content  # the control: unconstrained, no JSON
    with pytest.raises(ValueError):
        json.loads(free)


def test_regex_choice_grammar_and_json_object_hold_on_both_endpoints(server):
    model, client = server
    email = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
    chat_asks = [
        ("regex", {"guided_regex": email}),
        ("regex", {"structured_outputs": {"regex": email}}),
        ("choice", {"guided_choice": ["yes", "no", "it depends"]}),
        ("choice", {"structured_outputs": {"choice": ["left", "right"]}}),
        ("grammar", {"guided_grammar": 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'}),
        ("grammar", {"structured_outputs": {"grammar": 'root ::= "on" | "off"'}}),
    ]

    def ask(item):
        _, extra = item
        return _chat(server, extra_body=extra, max_tokens=60).choices[0]

    checks = {
        "regex": lambda t, e: re.fullmatch(email, t),
        "choice": lambda t, e: t in (e.get("guided_choice") or e["structured_outputs"]["choice"]),
        "grammar": lambda t, e: re.fullmatch(r"\(\d(,\d)*\)|on|off", t),
    }
    for (kind, extra), choice in zip(chat_asks, _all(ask, chat_asks)):
        assert choice.finish_reason == "stop" and checks[kind](choice.message.content, extra), (extra, choice.message.content)
    obj = _chat(server, response_format={"type": "json_object"}, max_tokens=40).choices[0]
    assert obj.message.content.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    schema = _obj({"n": {"type": "integer", "minimum": 0, "maximum": 99}}, ["n"])
    done = client.completions.create(model=model, prompt="JSON:", max_tokens=30, temperature=1.0, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_n_samples_and_a_stream_each_follow_the_schema(server):
    schema = _obj({"word": {"type": "string", "maxLength": 5}, "v": {"enum": [1, 2, 3]}}, ["word", "v"])
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    many = _chat(server, response_format=fmt, n=4, max_tokens=80, seed=3)
    assert len(many.choices) == 4
    for choice in many.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = _chat(server, response_format=fmt, max_tokens=80, stream=True, seed=4)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"}}}, "response_format"),
])
def test_an_unsupported_schema_feature_answers_400_naming_the_field(server, fmt, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, response_format=fmt, max_tokens=5)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error" and "cannot be enforced" in error["message"]


def test_a_malformed_regex_or_grammar_or_an_unhonoured_option_answers_400(server):
    for extra, param in (({"guided_regex": "[a-"}, "guided_regex"), ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
                         ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " *"}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as info:
            _chat(server, extra_body=extra, max_tokens=5)
        assert info.value.body["param"] == param


def test_disable_additional_properties_closes_every_object_schema_but_not_values():
    schema = {"type": "object", "properties": {"properties": {"type": "object"}, "c": {"const": {"type": "object"}}},
              "$defs": {"d": {"properties": {"x": {"type": "array", "items": {"type": "object"}}}}}}
    assert closed_objects(schema) == {
        "type": "object", "additionalProperties": False,
        "properties": {"properties": {"type": "object", "additionalProperties": False}, "c": {"const": {"type": "object"}}},
        "$defs": {"d": {"additionalProperties": False,
                        "properties": {"x": {"type": "array", "items": {"type": "object", "additionalProperties": False}}}}},
    }
