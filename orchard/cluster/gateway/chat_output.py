"""From a chat answer's text to OpenAI's message: reasoning, content and tool calls.

`ChatFormat` is how one model's answers read (its reasoning and tool-call parsers, from the
operator's flags or its template), `AnswerReader` applies it to one request, and
`AnswerStream` turns a growing answer into deltas: the parsers' answers only grow, so each
update sends what was not sent yet, and a call's id and name go out once, then its
arguments in pieces. Parsers whose markers are special tokens read the answer decoded from
its token ids with those tokens kept (`AnswerText`), since the engine's text drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchard.cluster.gateway.protocol_fields import FunctionCallDelta, ToolCallDelta
from orchard.cluster.gateway.reasoning import ReasoningParser, detect_reasoning, reasoning_parser_named
from orchard.cluster.gateway.tool_calls import new_call_id
from orchard.cluster.gateway.tool_parsers import CallScan, ToolParser, detect, harmony, parser_named
from orchard.node.detokenizer import IncrementalDetokenizer
from orchard.node.types import CompletionOutput


def template_text(tokenizer: Any) -> str | None:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    template = getattr(inner, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one lays out chat
        template = template.get("default") or template.get("tool_use")
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class ChatFormat:
    tool_parser: str | None
    reasoning_parser: str | None

    @classmethod
    def of(cls, tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None) -> ChatFormat:
        """The operator's choices, else what the model's template writes."""
        template = template_text(tokenizer)
        return cls(tool_parser or detect(template), reasoning_parser or detect_reasoning(template))


@dataclass
class Answer:
    reasoning: str = ""
    content: str = ""
    calls: list[CallScan] = field(default_factory=list)


class AnswerReader:
    """One request's way of reading its answers."""

    def __init__(self, fmt: ChatFormat, tools_active: bool, prompt_text: str, max_calls: int | None,
                 forced: ToolParser | None = None, tools: list[dict] | None = None):
        """`forced`: the parser of a constrained call (tool_choice required or named), which
        reads the whole answer; no reasoning is split from it."""
        self.tools: ToolParser | None = forced or (
            parser_named(fmt.tool_parser) if tools_active and fmt.tool_parser else None)
        if self.tools is not None and tools:
            self.tools.configure(tools)
        self.reasoning: ReasoningParser | None = (
            reasoning_parser_named(fmt.reasoning_parser) if fmt.reasoning_parser and forced is None else None)
        self.harmony = fmt.tool_parser == "openai" or fmt.reasoning_parser == "openai_gptoss"
        self.prompt_text = prompt_text
        self.max_calls = max_calls

    @property
    def needs_special_tokens(self) -> bool:
        return any(p is not None and p.needs_special_tokens for p in (self.tools, self.reasoning)) or self.harmony

    def read(self, text: str, final: bool, whole: bool = False) -> Answer:
        """`whole`: the finished answer, where a call that does not parse is content."""
        reasoning, rest = self.reasoning.split(text, final, self.prompt_text) if self.reasoning else ("", text)
        if self.tools is not None:
            scan = self.tools.parse(rest) if whole else self.tools.scan(rest, final)
            calls = scan.calls[: self.max_calls] if self.max_calls is not None else scan.calls
            return Answer(reasoning, scan.content, calls)
        content = harmony.content_of(rest, final) if self.harmony else rest
        return Answer(reasoning, content)


class AnswerText:
    """The answer's text as the reader needs it: the engine's, or decoded with special tokens."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], hidden_ids: set[int], with_special_tokens: bool):
        self._detok = None
        if with_special_tokens:
            def decode(ids):
                return tokenizer.decode([i for i in ids if i not in hidden_ids], skip_special_tokens=False)

            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, decode)

    def update(self, out: CompletionOutput) -> str:
        if self._detok is None:
            return out.text
        for token in out.token_ids_delta:
            self._detok.add(token)
        return self._detok.text


@dataclass
class _Sent:
    call_id: str
    named: bool = False
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class AnswerStream:
    """A growing answer as OpenAI deltas."""

    def __init__(self, reader: AnswerReader):
        self.reader = reader
        self._reasoning = self._content = ""
        self._calls: list[_Sent] = []

    @property
    def called(self) -> bool:
        return any(s.named for s in self._calls)

    def update(self, text: str, final: bool) -> Delta:
        answer = self.reader.read(text, final)
        delta = Delta(_grown(self._reasoning, answer.reasoning), _grown(self._content, answer.content))
        self._reasoning += delta.reasoning
        self._content += delta.content
        for i, call in enumerate(answer.calls):
            if call.name is None:
                break  # calls go out in order, each once its name is whole
            if i == len(self._calls):
                self._calls.append(_Sent(new_call_id()))
            piece = self._call_delta(i, call)
            if piece is not None:
                delta.tool_calls.append(piece)
        return delta

    def _call_delta(self, i: int, call: CallScan) -> ToolCallDelta | None:
        sent = self._calls[i]
        arguments = _grown(sent.arguments, call.arguments)
        if sent.named and not arguments:
            return None
        sent.arguments += arguments
        if sent.named:
            return ToolCallDelta(index=i, function=FunctionCallDelta(arguments=arguments))
        sent.named = True
        return ToolCallDelta(index=i, id=sent.call_id, type="function",
                             function=FunctionCallDelta(name=call.name, arguments=arguments))


def _grown(sent: str, now: str) -> str:
    """What `now` adds to what was sent (nothing if a parser took back text: it never should)."""
    return now[len(sent):] if now.startswith(sent) else ""


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by itself after calling."""
    return "tool_calls" if called and reason == "stop" else reason
