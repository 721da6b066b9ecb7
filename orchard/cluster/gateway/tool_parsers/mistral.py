"""Mistral: `[TOOL_CALLS]` then the calls, in one of the two forms its tokenizers use:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                              (v11 and later)

Both markers are special tokens, so this parser reads text decoded with them.
"""

from __future__ import annotations

import re

from orchard.cluster.gateway.tool_parsers.base import CallScan, Scan, ToolParser, call_from_object, held_back
from orchard.cluster.gateway.tool_parsers.json_scan import Malformed, scan_object, skip_ws, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_CALL_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(MARKER)
        if first < 0:
            return Scan(content=held_back(text, (MARKER,), final))
        scan = Scan(content=text[:first])
        body = text[first + len(MARKER):]
        j = skip_ws(body, 0)
        try:
            if body.startswith("[", j):
                scan.calls = _array_calls(body, j + 1)
            else:
                scan.calls = _named_calls(body)
        except Malformed:
            return Scan(content=text) if final else scan
        return scan


def _array_calls(body: str, j: int) -> list[CallScan]:
    calls = []
    while True:
        j = skip_ws(body, j)
        if j >= len(body) or body[j] == "]":
            return calls
        if body[j] == ",":
            j += 1
            continue
        if body[j] != "{":
            raise Malformed(f"expected a call object at {j}")
        obj = scan_object(body, j)
        calls.append(call_from_object(obj))
        if obj.end is None:
            return calls
        j = obj.end


def _named_calls(body: str) -> list[CallScan]:
    calls = []
    for part in body.split(MARKER):
        part = _CALL_ID.sub("", part)
        name, sep, rest = part.partition(ARGS)
        if not sep:
            continue  # the name is still arriving
        start = skip_ws(rest, 0)
        if start >= len(rest):
            calls.append(CallScan(name=name.strip()))
            continue
        end = value_end(rest, start)
        calls.append(CallScan(name=name.strip(), arguments=rest[start:end], complete=end is not None))
    return calls
