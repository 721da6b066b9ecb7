"""What a chat request's `tools` and `tool_choice` mean, before and after generation.

Before: which tools the template sees (none for `tool_choice: "none"`, which OpenAI
defines as "the model will not call a tool"), and for `required` or a named function the
JSON schema a constrained decoder must hold the output to (`forced_call_schema`, handed to
`structured.constraint_for`). After: parsed calls in OpenAI's shape, with fresh ids, and
only the first when `parallel_tool_calls` is false.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from orchard.cluster.gateway.errors import InvalidRequest
from orchard.cluster.gateway.protocol_fields import FunctionCall, NamedToolChoice, Tool, ToolCall
from orchard.cluster.gateway.tool_parsers.base import ToolParser
from orchard.cluster.gateway.tool_parsers.forced import NamedCallParser, RequiredCallsParser


def check_tool_choice(body: Any) -> None:
    """A tool_choice needs tools, and a named one must be among them."""
    choice = getattr(body, "tool_choice", None)
    if choice is None:
        return
    if not body.tools:
        raise InvalidRequest("tool_choice is only allowed when tools are given", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in body.tools}:
        raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                             param="tool_choice")


def tools_offered(body: Any) -> list[Tool]:
    """The tools the model may call: the request's, unless tool_choice is "none"."""
    tools = getattr(body, "tools", None) or []
    return [] if getattr(body, "tool_choice", None) == "none" else list(tools)


def template_tools(tools: list[Tool]) -> list[dict] | None:
    """Tools as Hugging Face chat templates take them (OpenAI's own shape, as dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] or None


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_call_schema(body: Any) -> dict | None:
    """The schema of the output a `required` or named tool_choice demands, else None.

    Named: the output is the function's arguments. Required: a JSON array of
    `{"name", "parameters"}` calls (one at most when parallel_tool_calls is false)."""
    choice = getattr(body, "tool_choice", None)
    tools = getattr(body, "tools", None) or []
    if isinstance(choice, NamedToolChoice):
        return next(_parameters(t) for t in tools if t.function.name == choice.function.name)
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def forced_parser(body: Any) -> ToolParser | None:
    """The parser of the answer a forced tool_choice constrains, else None."""
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        return NamedCallParser(choice.function.name)
    return RequiredCallsParser() if choice == "required" else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> ToolCall:
    return ToolCall(id=call_id or new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def allowed_calls(body: Any) -> int | None:
    """How many calls one answer may carry: one when parallel_tool_calls is false."""
    return 1 if getattr(body, "parallel_tool_calls", None) is False else None


def template_arguments(arguments: str) -> Any:
    """An earlier call's arguments as templates expect them: the JSON object, not its text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
