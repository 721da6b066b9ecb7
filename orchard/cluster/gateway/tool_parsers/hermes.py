"""Hermes / Qwen: each call a JSON object between `<tool_call>` and `</tool_call>`.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first call is content; Qwen2.5, Qwen3 and NousResearch Hermes templates
write this format.
"""

from __future__ import annotations

from orchard.cluster.gateway.tool_parsers.base import Scan, ToolParser, call_from_object, held_back
from orchard.cluster.gateway.tool_parsers.json_scan import Malformed, scan_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content=held_back(text, (START,), final))
        scan = Scan(content=text[:first])
        at = first
        while at >= 0:
            j = skip_ws(text, at + len(START))
            if j >= len(text):
                break
            if text[j] != "{":
                return Scan(content=text) if final else scan
            try:
                obj = scan_object(text, j)
            except Malformed:
                return Scan(content=text) if final else scan
            scan.calls.append(call_from_object(obj))
            if obj.end is None:
                break
            at = text.find(START, obj.end)
        return scan
