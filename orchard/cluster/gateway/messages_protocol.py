"""Anthropic's Messages API wire format (`POST /v1/messages`): requests and responses.

As with OpenAI's, every field Anthropic defines is declared: `service_tier` and
`cache_control` are accepted without effect (prefix caching is automatic), `metadata.user_id`
is a session key for routing, what cannot be honoured is refused naming the field, and
unknown fields are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchard.cluster.gateway.protocol_fields import FUNCTION_NAME, refused


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    """A block whose payload is accepted as Anthropic shapes it, then refused or ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


CacheControl = dict[str, Any] | None  # accepted, ignored


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Annotated[list | None, refused("citations are not supported")] = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


class ImageBlock(_Loose):
    type: Literal["image"]


class DocumentBlock(_Loose):
    type: Literal["document"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock | DocumentBlock,
    Field(discriminator="type"),
]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoiceParam(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Request):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, description="not enforced: the model thinks as long as it does")


class MetadataParam(_Request):
    user_id: str | None = None


class MessagesRequest(_Request):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    metadata: MetadataParam | None = Field(None, description="user_id is a session key for routing")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted, ignored")
    container: Annotated[Any, refused("container is not supported: no code execution here")] = None
    mcp_servers: Annotated[list | None, refused("mcp_servers is not supported")] = None


class CountTokensRequest(_Request):
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


# ---- responses ------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
