"""What a request's output constraint is, as one dict the engine can be handed.

A request constrains its output through `response_format`, vLLM's `structured_outputs` or
`guided_*` fields (parsed and validated in `protocol_fields.ConstraintFields`), or through a
`tool_choice` of `required` or a named function, which asks for the call's JSON
(`tool_calls.forced_call_schema` builds its schema). `constraint_for` is the one place
that turns these into a constraint; until the engine can enforce one, every constraint is
refused with a 400 rather than ignored.
"""

from __future__ import annotations

from typing import Any

from cluster.gateway.errors import InvalidRequest
from cluster.gateway.tool_calls import forced_call_schema


def constraint_for(request: Any) -> dict | None:
    """The decoding constraint `request` asks for, or None when its output is free.

    A forced tool call would be `{"json_schema": forced_call_schema(request)}`."""
    schema = forced_call_schema(request)
    if schema is not None:
        raise InvalidRequest(
            "tool_choice 'required' or a named function needs constrained decoding of the call, which is not "
            "supported yet; use tool_choice 'auto'",
            param="tool_choice",
        )
    fields = request.constraint_fields() if hasattr(request, "constraint_fields") else []
    if fields:
        raise InvalidRequest("response_format is not supported yet", param=fields[0])
    return None
