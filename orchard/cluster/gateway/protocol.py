"""The OpenAI wire format the gateway speaks: request and response models.

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument"), so a
client never believes a parameter took effect when it was ignored. Ranges are declared on
the fields so that /openapi.json states them and pydantic rejects bad values before any
work starts; the engine's own `SamplingParams` checks remain the second line.

Requests are also strict, as OpenAI's own server is: `"stream": "yes"` or `"n": "2"` is a
400, not a value pydantic guessed; a JSON integer still counts as a number where a float
is asked for (`"temperature": 1`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from orchard.cluster.gateway.protocol_fields import (
    ConstraintFields,
    ContentPart,
    LogitBias,
    Metadata,
    Modalities,
    OmitsNone,
    ServiceTier,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallIn,
    ToolChoice,
    only,
    refused,
)

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopField = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None

# Cross-field rules, stated in the schema so clients (and fuzzers) can see them.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


# ---- shared ---------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="accepted, ignored: streams here are not padded")


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(0, description="prompt tokens served from the prefix cache, not computed")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class _SamplingFields(ConstraintFields):
    """Parameters both endpoints share, with OpenAI's ranges (`n` capped by the engine).

    Ignored here, accepted for clients that send them (docs/api-fields.md): `metadata`,
    `store`, `service_tier`, `safety_identifier`, `prompt_cache_retention`. `prompt_cache_key`
    and `user` name the conversation for sticky routing (orchard/cluster/gateway/sessions.py)."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="any integer; the same seed repeats a sampled completion")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias = None
    user: str | None = Field(None, description="a session key for routing, after prompt_cache_key")
    metadata: Metadata = Field(None, description="accepted, ignored")
    store: bool | None = Field(None, description="accepted, ignored: nothing is stored")
    service_tier: ServiceTier = Field(None, description="accepted, ignored: one tier")
    safety_identifier: str | None = Field(None, description="accepted, ignored")
    prompt_cache_key: str | None = Field(None, description="a session key: requests sharing it stay on one node")
    prompt_cache_retention: Literal["in-memory", "24h"] | None = Field(None, description="accepted, ignored")
    # Extensions that vLLM also accepts; OpenAI's own clients send them through `extra_body`.
    top_k: int | None = Field(None, ge=0, description="orchard/vLLM extension: sample from the k likeliest; 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="orchard/vLLM extension")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="orchard/vLLM extension")
    ignore_eos: bool = Field(False, description="orchard/vLLM extension: generate max_tokens whatever the model says")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64, description="orchard/vLLM extension")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ---- /v1/completions ------------------------------------------------------------------

PromptField = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=64)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
)


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM]})

    prompt: PromptField
    max_tokens: int | None = Field(None, ge=1, description="defaults to 16, as OpenAI's legacy endpoint")
    logprobs: int | None = Field(None, ge=0, le=20, description="how many top alternatives to report per token")
    echo: bool = Field(False, description="the prompt's text before each completion (not with logprobs)")
    suffix: Annotated[str | None, refused("suffix is not supported: the engine only appends")] = None
    best_of: int | None = Field(None, ge=1, le=64, description="only equal to n (no ranking of candidates)")

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported: candidates are not ranked")
        return value

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs is not supported: prompt tokens get no logprobs")
        return value


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- /v1/chat/completions -------------------------------------------------------------


class ChatMessage(_Request):
    """One turn. Checked by role as OpenAI does: `tool` turns answer a `tool_call_id`,
    only assistants carry `tool_calls`; non-text content and deprecated function turns
    are refused with the reason."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = Field(None, description="orchard/vLLM extension: an assistant turn's thinking")
    function_call: Annotated[dict | None, refused("function_call is deprecated and not supported: use tool_calls")] = None
    audio: Annotated[dict | None, refused("audio is not supported: these models read and write text only")] = None

    @model_validator(mode="after")
    def _fits_its_role(self) -> ChatMessage:
        for part in self.content if isinstance(self.content, list) else []:
            if part.type in ("image_url", "input_audio", "file"):
                raise ValueError(f"{part.type} content is not supported: the served model reads text only")
        if self.role == "function":
            raise ValueError("the function role is deprecated and not supported: use the tool role")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs on tool messages only")
        if self.role != "assistant" and (self.tool_calls or self.reasoning_content or self.refusal):
            raise ValueError("tool_calls, reasoning_content and refusal belong on assistant messages only")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if p.type == "text" else p.refusal for p in self.content)


ChatTemplateKwargs = dict[str, Any] | None


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS]}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI in favour of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="handed to the chat template (gpt-oss reads it); no effect on models that do not")
    chat_template_kwargs: ChatTemplateKwargs = Field(None, description="orchard/vLLM extension: extra template variables")
    modalities: Modalities = None
    prediction: dict[str, Any] | None = Field(None, description="accepted, ignored: a latency hint; the output is the same")
    verbosity: Annotated[
        Literal["low", "medium", "high"] | None,
        only({"medium"}, "verbosity other than medium is not supported: the model's length is its own"),
    ] = None
    audio: Annotated[dict[str, Any] | None, refused("audio output is not supported: these models write text", empty_ok=False)] = None
    web_search_options: Annotated[dict[str, Any] | None, refused("web_search_options is not supported: no search here", empty_ok=False)] = None
    functions: Annotated[list | None, refused("functions is deprecated and not supported: use tools")] = None
    function_call: Annotated[Any, refused("function_call is deprecated and not supported: use tool_choice")] = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(OmitsNone):
    """OpenAI's message, plus vLLM's `reasoning_content` (left out when there is none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    omit_when_none: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content")


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(OmitsNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    omit_when_none: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content")


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- /v1/models, /health, /v1/cluster -------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "orchard"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(_Response):
    status: Literal["ok", "starting"]


class NodeInfo(BaseModel):
    """One serving node as /v1/cluster reports it; backends may add fields."""

    model_config = ConfigDict(extra="allow")

    node: str
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    running: int = 0
    waiting: int = 0


class ClusterInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    nodes: list[NodeInfo]
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    queue_depth: int = 0
