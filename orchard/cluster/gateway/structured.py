"""What a request's output constraint is, as one dict the engine can be handed.

A request constrains its output through `response_format`, vLLM's `structured_outputs` or
`guided_*` fields (parsed and validated in `protocol_fields.ConstraintFields`), or through a
`tool_choice` of `required` or a named function, which asks for the call's JSON
(`tool_calls.forced_call_schema` builds its schema). `constraint_for` is the one place
that turns these into the engine's constraint dict (`orchard.node.constraint.Constraint.from_dict`
reads it), compiling it once here so that a schema feature the grammar engine cannot
enforce answers 400 naming the request's field, before any work starts.

Every constraint is enforced, `strict` or not: a non-strict json_schema is held to exactly
as a strict one (OpenAI only tries). Output JSON has no free whitespace, so vLLM's
`disable_any_whitespace` is what happens anyway; a `whitespace_pattern` is refused.
"""

from __future__ import annotations

import json
from typing import Any

from orchard.cluster.gateway.errors import InvalidRequest
from orchard.cluster.gateway.tool_calls import forced_call_schema
from orchard.node.constraint import Constraint, UnsupportedConstraint


def constraint_for(request: Any) -> dict | None:
    """The decoding constraint `request` asks for, or None when its output is free."""
    forced = forced_call_schema(request)  # tool_choice required or named: the call's JSON, read unwrapped
    fields = request.constraint_fields() if hasattr(request, "constraint_fields") else []
    if forced is not None:
        if fields:
            raise InvalidRequest(f"{fields[0]} cannot be combined with a tool_choice that forces a call", param=fields[0])
        field, spec = "tool_choice", {"json_schema": forced}
    elif not fields:
        return None
    else:
        field = fields[0]
        spec = _SPECS[field](getattr(request, field))
    try:
        Constraint.from_dict(spec)  # compiled (and cached) now: an unsupported feature is a 400 naming the field
    except UnsupportedConstraint as exc:
        raise InvalidRequest(f"{field} cannot be enforced: {exc}", param=field) from None
    return spec


def _response_format(fmt: Any) -> dict:
    if fmt.type == "json_object":
        return {"json_object": True}
    schema = fmt.json_schema.schema_
    if schema is None:  # a named format without a schema: any JSON object
        return {"json_object": True}
    return {"json_schema": schema, "strict": bool(fmt.json_schema.strict)}


def _structured_outputs(so: Any) -> dict:
    if so.whitespace_pattern is not None:
        raise InvalidRequest("structured_outputs.whitespace_pattern is not supported: JSON is generated without "
                             "free whitespace", param="structured_outputs")
    if so.json_ is not None:
        schema = so.json_
        if so.disable_additional_properties:
            schema = closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
        return {"json_schema": schema}
    if so.json_object:
        return {"json_object": True}
    for key in ("regex", "choice", "grammar"):
        if getattr(so, key) is not None:
            return {key: getattr(so, key)}
    raise InvalidRequest("structured_outputs needs one of json, regex, choice, grammar, json_object", param="structured_outputs")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "contains", "not", "if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """vLLM's `disable_additional_properties`: every object schema that does not say otherwise takes no extra keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SPECS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda schema: {"json_schema": schema},
    "guided_regex": lambda regex: {"regex": regex},
    "guided_choice": lambda choices: {"choice": list(choices)},
    "guided_grammar": lambda grammar: {"grammar": grammar},
}
