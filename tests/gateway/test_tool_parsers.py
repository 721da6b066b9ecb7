"""Tool-call and reasoning parsers on text: whole answers, and the same answers streamed
in every chunking, whose deltas must add up to the whole answer's parse."""

from __future__ import annotations

import json

import pytest

from orchard.cluster.gateway.chat_output import AnswerReader, AnswerStream, ChatFormat
from orchard.cluster.gateway.reasoning import detect_reasoning
from orchard.cluster.gateway.tool_parsers import detect, parser_named
from orchard.cluster.gateway.tool_parsers.json_scan import Malformed, value_end

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" } brace"}
W = json.dumps(WEATHER)

#: (parser, answer, content, [(name, arguments)])
CASES = [
    ("hermes", f'Checking.<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', "Checking.",
     [("get_weather", WEATHER)]),
    ("hermes", f'<tool_call>{{"name": "a", "arguments": {{}}}}</tool_call>\n<tool_call>{{"arguments": {W}, "name": "b"}}</tool_call>',
     "", [("a", {}), ("b", WEATHER)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("a", {"x": 1})]),
    ("hermes", "no calls < here", "no calls < here", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}', "",
     [("a", {}), ("b", {"k": 2})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", f'Sure[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "b", "arguments": {{}}}}]', "Sure",
     [("get_weather", WEATHER), ("b", {})]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]b[ARGS]{{}}', "", [("get_weather", WEATHER), ("b", {})]),
    ("openai", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
               f"<|constrain|>json<|message|>{W}<|call|>", "", [("get_weather", WEATHER)]),
    ("openai", "<|channel|>final<|message|>Hello there.", "Hello there.", []),
    ("qwen3_coder", "On it.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
                    "[1, 2]\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=b>\n</function>\n</tool_call>",
     "On it.", [("get_weather", {"city": "Paris", "days": [1, 2]}), ("b", {})]),
]


def _stream(reader: AnswerReader, text: str, step: int):
    stream = AnswerStream(reader)
    content, calls = "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        delta = stream.update(text[:cut], final=cut == len(text))
        content += delta.content
        for piece in delta.tool_calls:
            entry = calls.setdefault(piece.index, {"name": piece.function.name, "id": piece.id, "arguments": ""})
            assert (piece.id is not None) == (entry["arguments"] == "" and piece.function.name is not None)
            entry["arguments"] += piece.function.arguments or ""
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answers_parse(parser, text, content, calls):
    scan = parser_named(parser).parse(text)
    assert scan.content == content
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_deltas_add_up_to_the_whole_parse(parser, text, content, calls, step):
    reader = AnswerReader(ChatFormat(parser, None), True, "", None)
    assert _stream(reader, text, step) == (content, calls)


def test_partial_markers_are_held_back_until_known():
    reader = AnswerReader(ChatFormat("hermes", None), True, "", None)
    stream = AnswerStream(reader)
    assert stream.update("Hello <tool_", final=False).content == "Hello "
    assert stream.update("Hello <tool_x", final=False).content == "<tool_x"


@pytest.mark.parametrize(("prompt", "text", "reasoning", "content"), [
    ("<|im_start|>assistant\n", "<think>\nstep one\n</think>\n\nThe answer.", "step one", "The answer."),
    ("<|im_start|>assistant\n<think>\n", "opened by the template</think>Answer", "opened by the template", "Answer"),
    ("<|im_start|>assistant\n", "No thinking here.", "", "No thinking here."),
    ("<|im_start|>assistant\n<think>\n", "cut off mid thought", "cut off mid thought", ""),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_think_blocks_split_into_reasoning_and_content(prompt, text, reasoning, content, step):
    reader = AnswerReader(ChatFormat(None, "qwen3"), False, prompt, None)
    whole = reader.read(text, final=True, whole=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    stream = AnswerStream(reader)
    got = ["", ""]
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        d = stream.update(text[:cut], final=cut == len(text))
        got[0] += d.reasoning
        got[1] += d.content
    assert got == [reasoning, content]


def test_harmony_reasoning_is_the_analysis_channel():
    text = ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>Done.")
    answer = AnswerReader(ChatFormat("openai", "openai_gptoss"), False, "", None).read(text, final=True, whole=True)
    assert (answer.reasoning, answer.content, answer.calls) == ("Think first.", "Done.", [])


def test_a_call_cut_off_or_broken_is_content_in_the_whole_answer():
    for text in ('<tool_call>{"name": "f", "arguments": {"a": 1', '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'):
        scan = parser_named("hermes").parse(text)
        assert scan.calls == [] and scan.content == text


def test_json_scan_tells_incomplete_from_malformed():
    assert value_end('{"a": [1, "]"]}', 0) == 15
    assert value_end('{"a": [1, "]"', 0) is None
    with pytest.raises(Malformed):
        value_end('{"a": [1}', 0)


@pytest.mark.parametrize(("template", "tools", "reasoning"), [
    ("{{ '<tool_call>' }}{{ '<think>' }}...{{ '</think>' }}", "hermes", "qwen3"),
    ("{{ '[TOOL_CALLS]' }}", "mistral", None),
    ("<tool_call>\n<function={{ name }}>\n<parameter=", "qwen3_coder", None),
    ("<|start_header_id|>ipython<|end_header_id|> <|python_tag|>", "llama3_json", None),
    ("<|start|>{{ m }}<|channel|>analysis<|message|><|call|>", "openai", "openai_gptoss"),
    ("{{ 'Hi' }}", None, None),
    (None, "hermes", None),  # no template: ChatML, which presents tools the Hermes way
])
def test_parsers_are_chosen_from_the_template(template, tools, reasoning):
    assert detect(template) == tools
    assert detect_reasoning(template) == reasoning


def test_unknown_parser_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        parser_named("nope")


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_forced_calls_are_read_unwrapped(step):
    from orchard.cluster.gateway.tool_parsers.forced import NamedCallParser, RequiredCallsParser

    named = AnswerReader(ChatFormat("hermes", "qwen3"), True, "<think>", None, NamedCallParser("get_weather"))
    assert _stream(named, W, step) == ("", [("get_weather", WEATHER)])
    required = AnswerReader(ChatFormat("hermes", None), True, "", None, RequiredCallsParser())
    text = f'[{{"name": "get_weather", "parameters": {W}}}, {{"name": "b", "parameters": {{}}}}]'
    assert _stream(required, text, step) == ("", [("get_weather", WEATHER), ("b", {})])


def test_parsers_that_read_special_tokens_get_them_and_not_the_end_of_turn():
    """Mistral's and harmony's markers are special tokens, which the engine's text drops: they
    read the answer decoded from its ids with them, less the stop tokens."""
    from orchard.cluster.gateway.chat_output import AnswerText
    from orchard.node.types import CompletionOutput
    from tests.gateway.scripted import demo_tokenizer

    tokenizer = demo_tokenizer()
    ids = tokenizer.encode("hi<|im_start|>there<|endoftext|>", add_special_tokens=False)
    end = tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    kept, plain = AnswerText(tokenizer, [], set(end), True), AnswerText(tokenizer, [], set(end), False)
    out = CompletionOutput(index=0, text="hithere", token_ids_delta=list(ids))
    assert kept.update(out) == "hi<|im_start|>there"
    assert plain.update(out) == "hithere"


def test_qwen3_coder_values_take_their_type_from_the_tools_schema():
    parser = parser_named("qwen3_coder")
    parser.configure([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"zip": {"type": "string"}, "n": {"type": "integer"}}}}}])
    text = "<tool_call>\n<function=f>\n<parameter=zip>\n12345\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>"
    assert json.loads(parser.parse(text).calls[0].arguments) == {"zip": "12345", "n": 7}
