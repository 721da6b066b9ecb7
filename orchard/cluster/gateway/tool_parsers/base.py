"""What every tool-call parser answers: the content and the calls found in a model's text.

A parser is asked again each time the text grows (`scan(text, final=False)`) and once
more at the end (`final=True`). Its answers only ever grow: the content and each call's
arguments so far are prefixes of what it will say later, which is what lets the stream
send them as deltas. Text that might still become a call's opening marker is held back
until it is known not to be one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from orchard.cluster.gateway.tool_parsers.json_scan import ObjectScan


@dataclass
class CallScan:
    name: str | None = None  # known once the name is complete
    arguments: str = ""  # the arguments' JSON text so far: a prefix of its final text
    complete: bool = False


@dataclass
class Scan:
    content: str = ""
    calls: list[CallScan] = field(default_factory=list)


class ToolParser:
    """One output format. `needs_special_tokens`: its markers are special tokens, so it
    must read text decoded with them (the engine's text leaves them out)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False

    def configure(self, tools: list[dict]) -> None:
        """The request's tools (OpenAI's shape), for formats that need their schemas."""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> Scan:
        """The final answer: every call complete with JSON-object arguments, else all content."""
        scan = self.scan(text, final=True)
        if all(c.complete and c.name and is_json_object(c.arguments) for c in scan.calls):
            return scan
        return Scan(content=text)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def held_back(text: str, markers: tuple[str, ...], final: bool) -> str:
    """`text` without a tail that could be the beginning of one of `markers`."""
    if final:
        return text
    for k in range(min(len(text), max(len(m) for m in markers)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return text[:-k]
    return text


def call_from_object(obj: ObjectScan, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallScan:
    """A call from a `{"name": ..., "arguments": {...}}` object scanned so far."""
    call = CallScan(name=obj.string("name"), complete=obj.end is not None)
    key = next((k for k in argument_keys if k in obj.spans), None)
    raw = obj.raw(key) if key else None
    if raw is None:
        call.arguments = "{}" if call.complete else ""
    elif raw.startswith('"'):  # arguments sent as a JSON string: only whole, decoded
        call.arguments = json.loads(raw) if obj.complete(key) else ""
    else:
        call.arguments = raw
    return call
