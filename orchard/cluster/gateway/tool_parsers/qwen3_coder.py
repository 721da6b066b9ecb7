"""Qwen3-Coder's XML calls: a function element with one element per parameter.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are text; each becomes JSON by the type the tool's schema gives the parameter
(a string stays a string), else by what it parses as. The arguments stream a parameter at a
time, each once its closing tag has arrived.
"""

from __future__ import annotations

import json
import re
from typing import Any

from orchard.cluster.gateway.tool_parsers.base import CallScan, Scan, ToolParser, held_back

START = "<tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self):
        self.types: dict[str, dict[str, Any]] = {}  # function -> parameter -> its JSON schema type

    def configure(self, tools: list[dict]) -> None:
        for tool in tools:
            fn = tool.get("function", {})
            props = (fn.get("parameters") or {}).get("properties") or {}
            self.types[fn.get("name", "")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        first = first if first >= 0 else text.find("<function=")
        if first < 0:
            return Scan(content=held_back(text, (START, "<function="), final))
        scan = Scan(content=text[:first])
        for block in re.split(r"(?=<function=)", text[first:])[1:]:
            head = _FUNCTION.match(block)
            if head is None:
                break
            name = head.group(1).strip()
            done = "</function>" in block
            pieces = [f"{json.dumps(k.strip())}: {self._value(name, k.strip(), v)}" for k, v in _PARAMETER.findall(block)]
            arguments = "{" + ", ".join(pieces) + ("}" if done else "")
            scan.calls.append(CallScan(name=name, arguments=arguments, complete=done))
        return scan

    def _value(self, function: str, parameter: str, text: str) -> str:
        kind = self.types.get(function, {}).get(parameter)
        if kind == "string":
            return json.dumps(text)
        try:
            return json.dumps(json.loads(text))
        except ValueError:
            return json.dumps(text)
