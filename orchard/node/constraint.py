"""What a request's output must match, compiled once where the request enters.

A `Constraint` is plain data (a kind and its source text) plus the grammar llguidance
compiles from it, so it crosses Ray pickled and the node never compiles it again. Building
one validates it: a schema keyword, format or grammar construct that llguidance cannot
enforce raises `UnsupportedConstraint` (a 400 at the gateway) instead of being ignored.

JSON is generated compactly with Python's separators (`", "`, `": "`) and no other
whitespace: free whitespace is a place where a weak model can spin until `max_tokens`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from orchard.node.errors import InvalidSamplingParams

Kind = Literal["json", "regex", "choice", "grammar"]

#: llguidance's JSON options: no free whitespace, json.dumps's separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: What `response_format: json_object` means: any JSON object.
ANY_OBJECT = {"type": "object"}


class UnsupportedConstraint(InvalidSamplingParams):
    """The schema, regex or grammar uses something the grammar engine cannot enforce (or is malformed)."""

    def __init__(self, message: str):
        super().__init__("constraint", message)

    def __reduce__(self):
        return UnsupportedConstraint, (self.message,)


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    source: str  # the JSON schema as text, the regex, the choices as a JSON list, or a Lark/GBNF grammar
    grammar: str = field(init=False, repr=False, compare=False)  # llguidance's compiled form

    def __post_init__(self):
        object.__setattr__(self, "grammar", _compile(self.kind, self.source))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Constraint:
        """The gateway's shape: {"json_object": True} | {"json_schema": {...}, "strict": bool} |
        {"regex": str} | {"choice": [str, ...]} | {"grammar": str}."""
        keys = set(spec) - {"strict"}
        if len(keys) != 1:
            raise UnsupportedConstraint(f"exactly one of json_object, json_schema, regex, choice, grammar is needed, got {sorted(keys)}")
        (key,) = keys
        value = spec[key]
        if key == "json_object":
            return cls("json", json.dumps(ANY_OBJECT))
        if key == "json_schema":
            if isinstance(value, str):  # vLLM's guided_json accepts the schema as text
                value = _parse_json(value)
            if not isinstance(value, dict):
                raise UnsupportedConstraint("json_schema must be a JSON object")
            return cls("json", json.dumps(value))
        if key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise UnsupportedConstraint("choice must be a non-empty list of non-empty strings")
            return cls("choice", json.dumps(value))
        if key in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise UnsupportedConstraint(f"{key} must be a non-empty string")
            return cls(key, value)
        raise UnsupportedConstraint(f"unknown constraint {key!r}")


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UnsupportedConstraint(f"json_schema is not valid JSON: {exc}") from None


@functools.lru_cache(maxsize=256)  # the gateway validates a constraint, then SamplingParams compiles the same text
def _compile(kind: Kind, source: str) -> str:
    try:
        grammar = _to_llguidance(kind, source)
    except (ValueError, KeyError, TypeError, GbnfToLarkError) as exc:  # a malformed schema or GBNF text
        raise UnsupportedConstraint(str(exc)) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise UnsupportedConstraint(messages[0] if messages else "the grammar engine refused it")
    return grammar


def _to_llguidance(kind: Kind, source: str) -> str:
    if kind == "json":
        grammar = LLMatcher.grammar_from_json_schema(_parse_json(source), overrides=JSON_OPTIONS)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(source)
    elif kind == "choice":
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(source)))
    elif kind == "grammar":
        grammar = LLMatcher.grammar_from_lark(any_to_lark(source))  # GBNF (`::=`) is translated to Lark
    else:
        raise UnsupportedConstraint(f"unknown constraint kind {kind!r}")
    return grammar
