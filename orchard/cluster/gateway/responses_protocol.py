"""OpenAI's Responses API wire format (`POST /v1/responses`): the request and its items.

Every field of the create request is declared: those without effect here are accepted
(`metadata`, `service_tier`, `safety_identifier`, `prompt_cache_retention`, `include`,
`truncation: "disabled"`, `moderation`; `prompt_cache_key` and `user` are session keys for
routing), those that cannot be honoured are refused naming the
field, unknown ones are a 400. Responses are built as plain dicts in `responses_api`, in the
shape OpenAI's SDK reads.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchard.cluster.gateway.protocol_fields import FUNCTION_NAME, Metadata, only, refused


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputRefusal(_Request):
    type: Literal["refusal"]
    refusal: str


class InputMedia(_Loose):
    """An image, file or audio part: refused, the served model reads text only."""

    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[InputText | InputRefusal | InputMedia, Field(discriminator="type")]


class MessageItem(_Request):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(getattr(p, "text", None) or getattr(p, "refusal", "") for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Loose):
    """Earlier reasoning sent back: accepted; its text is the turn's reasoning_content."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJSONObject(_Request):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextParam(_Request):
    format: Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")] | None = None
    verbosity: Annotated[Literal["low", "medium", "high"] | None,
                         only({"medium"}, "verbosity other than medium is not supported")] = None


class ReasoningParam(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="accepted: the full reasoning is returned")
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    metadata: Metadata = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Annotated[Literal["auto", "disabled"] | None,
                          only({"disabled"}, "truncation auto is not supported: a prompt too long is a 400")] = None
    moderation: Any = None
    top_logprobs: Annotated[int | None, refused("top_logprobs is not supported on /v1/responses")] = None
    background: Annotated[bool | None, refused("background is not supported: responses run while the request waits")] = None
    conversation: Annotated[Any, refused("conversation is not supported: use previous_response_id")] = None
    prompt: Annotated[Any, refused("prompt templates are not supported")] = None
    context_management: Annotated[Any, refused("context_management is not supported")] = None
