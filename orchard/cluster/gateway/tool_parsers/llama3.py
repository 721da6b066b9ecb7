"""Llama 3.x JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`, or
several joined by `;`, after an optional `<|python_tag|>`.

An answer that opens with a brace is taken for a call until its object says otherwise
(no `name`); then it is all content.
"""

from __future__ import annotations

from orchard.cluster.gateway.tool_parsers.base import Scan, ToolParser, call_from_object
from orchard.cluster.gateway.tool_parsers.json_scan import Malformed, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]) and start < len(text):
            return Scan()
        if start >= len(text):
            return Scan() if not final else Scan(content=text)
        if text[start] != "{":
            return Scan(content=text)
        scan = Scan()
        j = start
        while j < len(text):
            try:
                obj = scan_object(text, j)
            except Malformed:
                return Scan(content=text) if final or not scan.calls else scan
            call = call_from_object(obj)
            if call.name is None and (obj.complete("name") or obj.end is not None):
                return Scan(content=text)  # an object, but not a call
            scan.calls.append(call)
            if obj.end is None:
                break
            j = skip_ws(text, obj.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            if j < len(text) and text[j] != "{":
                return Scan(content=text) if final else scan
        return scan
