"""Tool-call parsers: from a model's text to OpenAI's `tool_calls`, one format per module.

    base.py       `ToolParser` (scan text as it grows, parse it at the end), `Scan`, `CallScan`
    json_scan.py  where a JSON value ends in text still arriving
    hermes.py     `<tool_call>{...}</tool_call>` (Hermes, Qwen2.5, Qwen3)
    llama3.py     `{"name": ..., "parameters": ...}` (Llama 3.x, after `<|python_tag|>` or bare)
    mistral.py    `[TOOL_CALLS]` in both of Mistral's forms
    harmony.py    gpt-oss's channels (`to=functions.NAME`)
    qwen3_coder.py  Qwen3-Coder's `<function=NAME><parameter=KEY>` XML
    forced.py     the unwrapped JSON a forced tool_choice's constrained answer is

Names are vLLM's (`--tool-call-parser`). Without the flag, the parser is chosen from the
markers the model's chat template writes (`detect`).
"""

from __future__ import annotations

from orchard.cluster.gateway.tool_parsers.base import CallScan, Scan, ToolParser
from orchard.cluster.gateway.tool_parsers.harmony import HarmonyParser
from orchard.cluster.gateway.tool_parsers.hermes import HermesParser
from orchard.cluster.gateway.tool_parsers.llama3 import Llama3JsonParser
from orchard.cluster.gateway.tool_parsers.mistral import MistralParser
from orchard.cluster.gateway.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3": HermesParser,  # Qwen3's JSON calls are Hermes'; vLLM serves them as hermes
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "openai": HarmonyParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3CoderParser,
}

#: Template markers, checked in order, and the parser that reads what such a template asks for.
_SIGNS = (
    ("<|channel|>", "openai"),
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>ipython", "llama3_json"),
)


def parser_named(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}") from None


def detect(template: str | None) -> str | None:
    """The parser for the format `template` lays calls out in; hermes for ChatML (no template)."""
    if template is None:
        return "hermes"
    return next((name for sign, name in _SIGNS if sign in template), None)


__all__ = ["PARSERS", "CallScan", "Scan", "ToolParser", "detect", "parser_named"]
