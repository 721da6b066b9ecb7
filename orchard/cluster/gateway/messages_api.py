"""Anthropic's Messages API on the chat path: `POST /v1/messages` and `/v1/messages/count_tokens`.

A Messages request is translated into the equivalent chat completion request (system
prompt, turns with their `tool_use` / `tool_result` blocks, tools, tool choice, thinking)
and run by `ChatServing` exactly as an OpenAI one, so templates, parsers and the engine
path are shared; its answer is laid out as content blocks, or streamed as Anthropic's
events. Errors leave in Anthropic's shape (`{"type": "error", "error": {...}}`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from orchard.cluster.gateway.chat_output import Answer, AnswerStream
from orchard.cluster.gateway.chat_serving import ChatRun, ChatServing
from orchard.cluster.gateway.errors import APIError, InvalidRequest, Unauthorized, as_api_error, validation_message
from orchard.cluster.gateway.guard import presented_key
from orchard.cluster.gateway.messages_protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    Usage,
)
from orchard.cluster.gateway.protocol import ChatCompletionRequest

MESSAGES_PATH = "/v1/messages"
KEY_HELP = "Missing or invalid API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'."
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error"}


def error_body(exc: BaseException) -> tuple[int, dict]:
    err = as_api_error(exc)
    return err.status, {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status, headers=getattr(as_api_error(exc), "headers", None))


def refusal_response(error: APIError) -> JSONResponse:
    """A refusal of the request guard (orchard/cluster/gateway/guard.py) in Anthropic's shape."""
    return error_response(Unauthorized(KEY_HELP) if isinstance(error, Unauthorized) else error)


# ---- Anthropic request -> chat request ------------------------------------------------


def _refuse_block(kind: str) -> InvalidRequest:
    return InvalidRequest(f"{kind} blocks are not supported here: the served model reads text only", param="messages")


def _user_turns(m: MessageParam) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    turns, text = [], []
    for block in m.content:
        if block.type == "tool_result":
            prefix = "(error) " if block.is_error else ""
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": prefix + block.text()})
        elif block.type == "text":
            text.append(block.text)
        else:
            raise _refuse_block(block.type)
    return turns + ([{"role": "user", "content": "".join(text)}] if text or not turns else [])


def _assistant_turn(m: MessageParam) -> dict:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in m.content:
        if block.type == "text":
            turn["content"] += block.text
        elif block.type == "tool_use":
            turn.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif block.type == "thinking":
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
        elif block.type != "redacted_thinking":
            raise _refuse_block(block.type)
    return turn


def _tool_choice(body) -> dict[str, Any]:
    choice = body.tool_choice
    if choice is None:
        return {}
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)}
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type tool needs the tool's name", param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for m in body.messages:
        messages.extend(_user_turns(m) if m.role == "user" else [_assistant_turn(m)])
    data: dict[str, Any] = {"model": body.model, "messages": messages, **_tool_choice(body)}
    if body.tools:
        data["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in body.tools]
    if body.thinking is not None:
        data["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if isinstance(body, MessagesRequest) and body.metadata is not None:
        data["user"] = body.metadata.user_id  # the session key (orchard/cluster/gateway/sessions.py)
    if isinstance(body, MessagesRequest):
        data.update(max_completion_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        raise InvalidRequest("; ".join(validation_message(e) for e in exc.errors()[:3])) from None


# ---- chat answers -> Anthropic --------------------------------------------------------


def content_blocks(answer: Answer) -> list[dict]:
    blocks: list[dict] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": json.loads(call.arguments)})
    return blocks


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str | None, stopped_by, called: bool, stops: list[str]) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in stops:
        return "stop_sequence", stopped_by
    return "end_turn", None


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class _Blocks:
    """The content blocks of a streamed answer: one open at a time, opened as its kind starts."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("text",) / ("thinking",) / ("tool_use", call index)

    def switch(self, key: tuple, start: dict) -> list[str]:
        if self.open == key:
            return []
        frames = self.close()
        self.index += 1
        self.open = key
        return [*frames, event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        frames = []
        if self.open == ("thinking",):
            frames.append(self.delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*frames, event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


class MessagesServing:
    def __init__(self, chats: ChatServing):
        self.chats = chats

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        _, _, _, prompt = await self.chats.prompt(chat_request(body))
        return CountTokensResponse(input_tokens=len(prompt.token_ids))

    async def serve(self, body: MessagesRequest, request: Request):
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        chat = chat_request(body)
        run = await self.chats.prepare(chat, request, rid)
        stops = body.stop_sequences or []
        if body.stream:
            events = await run.gen.open_stream(run.jobs, run.params)
            frames = self._stream(run, events, rid, stops)
            return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        [answer] = await run.answers()
        state = run.choices.states[0]
        reason, sequence = stop_reason(state.finish_reason, run.stop_reasons.get(0), bool(answer.calls), stops)
        return MessageResponse(id=rid, model=run.gen.info.name, content=content_blocks(answer), stop_reason=reason,
                               stop_sequence=sequence, usage=Usage(input_tokens=len(run.prompt_ids),
                                                                   output_tokens=state.num_tokens))

    async def _stream(self, run: ChatRun, events, rid: str, stops: list[str]):
        message = {"id": rid, "type": "message", "role": "assistant", "model": run.gen.info.name, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(run.prompt_ids), "output_tokens": 0}}
        yield event("message_start", {"type": "message_start", "message": message})
        stream, blocks = AnswerStream(run.reader), _Blocks()
        finish = None
        try:
            async for job, out in events:
                for _, c, text in run.add(job, out):
                    for frame in self._frames(stream.update(text, final=c.finished), blocks):
                        yield frame
                    finish = c.finish_reason or finish
        except Exception as exc:  # headers are sent: the stream is the only way left to tell
            yield event("error", error_body(exc)[1])
            return
        for frame in blocks.close():
            yield frame
        reason, sequence = stop_reason(finish, run.stop_reasons.get(0), stream.called, stops)
        usage = {"output_tokens": run.choices.states[0].num_tokens}
        yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage})
        yield event("message_stop", {"type": "message_stop"})

    def _frames(self, d, blocks: _Blocks):
        if d.reasoning:
            yield from blocks.switch(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            yield blocks.delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            yield from blocks.switch(("text",), {"type": "text", "text": ""})
            yield blocks.delta({"type": "text_delta", "text": d.content})
        for piece in d.tool_calls:
            if piece.id is not None:
                start = {"type": "tool_use", "id": tool_use_id(), "name": piece.function.name, "input": {}}
                yield from blocks.switch(("tool_use", piece.index), start)
            if piece.function and piece.function.arguments:
                yield blocks.delta({"type": "input_json_delta", "partial_json": piece.function.arguments})


#: Models /openapi.json lists for these routes (their bodies are read here, so FastAPI does not see them).
OPENAPI_MODELS = [(MessagesRequest, "validation"), (CountTokensRequest, "validation"),
                  (MessageResponse, "serialization"), (CountTokensResponse, "serialization"),
                  (AnthropicError, "serialization")]


def _ref(model: type) -> dict:
    return {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}


def _openapi(body: type, answer: type, stream: bool) -> dict:
    ok = {"application/json": _ref(answer)}
    if stream:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "Anthropic's stream events"}}
    errors = {str(s): {"description": "an error, in Anthropic's shape", "content": {"application/json": _ref(AnthropicError)}}
              for s in (400, 401, 404, 413, 429, 503, 504)}
    return {"requestBody": {"required": True, "content": {"application/json": _ref(body)}},
            "responses": {"200": {"description": "the answer", "content": ok}, **errors}}


def install_messages_api(app: FastAPI, chats: ChatServing, api_keys: frozenset[str]) -> None:
    messages = MessagesServing(chats)

    def check_key(request: Request) -> None:
        if api_keys and presented_key(request.scope) not in api_keys:
            raise Unauthorized(KEY_HELP)

    @app.post(MESSAGES_PATH, openapi_extra=_openapi(MessagesRequest, MessageResponse, stream=True))
    async def create_message(request: Request):
        try:
            check_key(request)
            body = MessagesRequest.model_validate_json(await request.body())
            return await messages.serve(body, request)
        except ValidationError as exc:
            return error_response(InvalidRequest("; ".join(validation_message(e) for e in exc.errors()[:3])))
        except Exception as exc:
            return error_response(exc)

    @app.post(f"{MESSAGES_PATH}/count_tokens", openapi_extra=_openapi(CountTokensRequest, CountTokensResponse, stream=False))
    async def count_message_tokens(request: Request):
        try:
            check_key(request)
            body = CountTokensRequest.model_validate_json(await request.body())
            return await messages.count_tokens(body)
        except ValidationError as exc:
            return error_response(InvalidRequest("; ".join(validation_message(e) for e in exc.errors()[:3])))
        except Exception as exc:
            return error_response(exc)
