"""Calls written under a forced `tool_choice`, where constrained decoding holds the whole
answer to the call's JSON (`tool_calls.forced_call_schema`) and no format markers appear:
a named function's answer is its arguments, a `required` answer a JSON array of
`{"name", "parameters"}` objects."""

from __future__ import annotations

from orchard.cluster.gateway.tool_parsers.base import CallScan, Scan, ToolParser
from orchard.cluster.gateway.tool_parsers.json_scan import Malformed, skip_ws
from orchard.cluster.gateway.tool_parsers.mistral import _array_calls


class NamedCallParser(ToolParser):
    name = "forced_named"

    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        arguments = text.strip() if final else text.lstrip()
        return Scan(calls=[CallScan(name=self.function, arguments=arguments, complete=final)])


class RequiredCallsParser(ToolParser):
    name = "forced_required"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return Scan(content=text) if final else Scan()
        try:
            return Scan(calls=_array_calls(text, start + 1))
        except Malformed:
            return Scan(content=text) if final else Scan()
