"""The parts of OpenAI's request surface beyond plain sampling: tools, content parts,
output constraints, and the fields this server accepts without effect or refuses.

Every field OpenAI defines is declared, so a client's request is never refused for a field
it may send; a field that cannot be honoured here is refused by its validator with a 400
naming it (`refused`), and one that has no effect on the output (`user`, `metadata`,
`store`, ...) is accepted and listed in docs/api-fields.md. The constraint fields are only
parsed and validated here; what they mean for decoding is `structured.py`'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer, model_validator

FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"  # OpenAI's rule for function names, plus the dot harmony uses


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def refused(why: str, empty_ok: bool = True):
    """A validator refusing any value but None, and but an empty one (False, {}, [], "")
    unless `empty_ok` is false (where sending the field at all asks for something)."""

    def check(value: Any) -> Any:
        if value or (value is not None and not empty_ok):
            raise ValueError(why)
        return value

    return AfterValidator(check)


def only(allowed: set, why: str):
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise ValueError(why)
        return value

    return AfterValidator(check)


# ---- fields accepted and ignored, or refused ------------------------------------------

Metadata = dict[str, Annotated[str, Field(max_length=512)]] | None
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"] | None
LogitBias = Annotated[
    dict[str, float] | None,
    refused("logit_bias is not supported: the engine applies no per-token bias"),
]

Modalities = Annotated[
    list[Literal["text", "audio"]] | None,
    AfterValidator(lambda v: _no_audio(v)),
]


def _no_audio(value: list[str] | None) -> list[str] | None:
    if value and "audio" in value:
        raise ValueError("audio output is not supported: these models write text")
    return value


# ---- message content ------------------------------------------------------------------


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class _Unsupported(_Request):
    """A content part of a kind these text-only models cannot read: its payload is accepted
    as OpenAI shapes it, then the message is refused (see `ChatMessage`)."""

    model_config = ConfigDict(extra="allow", strict=True)


class ImageContentPart(_Unsupported):
    type: Literal["image_url"]


class AudioContentPart(_Unsupported):
    type: Literal["input_audio"]


class FileContentPart(_Unsupported):
    type: Literal["file"]


class RefusalContentPart(_Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextContentPart | ImageContentPart | AudioContentPart | FileContentPart | RefusalContentPart,
    Field(discriminator="type"),
]


# ---- tools ----------------------------------------------------------------------------


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Request):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    """A call the assistant made, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCallIn


# ---- output constraints (parsed here; structured.py decides what they do) -------------


class JSONSchemaFormat(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema, Field(discriminator="type")
]


def _json_schema_value(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A schema given as JSON text must be a JSON object."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError("a JSON schema must be a JSON object")
    return value


SchemaValue = Annotated[str | dict[str, Any] | None, AfterValidator(_json_schema_value)]
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: SchemaValue = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Choices = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


class ConstraintFields(_Request):
    """The fields that ask for constrained output, on both endpoints."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="orchard/vLLM extension")
    guided_json: SchemaValue = Field(None, description="orchard/vLLM extension (deprecated by vLLM for structured_outputs)")
    guided_regex: Annotated[str, Field(min_length=1)] | None = Field(None, description="orchard/vLLM extension")
    guided_choice: Choices = Field(None, description="orchard/vLLM extension")
    guided_grammar: Annotated[str, Field(min_length=1)] | None = Field(None, description="orchard/vLLM extension")

    def constraint_fields(self) -> list[str]:
        """The names of the constraint fields this request sets (a text response_format sets none)."""
        names = [n for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            names.insert(0, "response_format")
        return names

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self.constraint_fields()
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {len(given)}: {', '.join(given)}")
        return self


# ---- response parts -------------------------------------------------------------------


class _DropsNone(_Response):
    """Serialized without its unset (None) fields, as OpenAI's stream deltas are."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class OmitsNone(_Response):
    """Serialized without the fields named in `omit_when_none` while they are None: the
    extensions (`reasoning_content`) and optional parts (`tool_calls`) OpenAI leaves out."""

    omit_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _lean(self, handler):
        data = handler(self)
        for key in self.omit_when_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_DropsNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_DropsNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None
