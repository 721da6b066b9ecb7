"""OpenAI's Responses API on the chat path: `POST /v1/responses`, and `GET` of a stored one.

A Responses request (input items, instructions, function tools, `previous_response_id`)
becomes the equivalent chat request and runs through `ChatServing`; its answer is laid out
as output items (reasoning, message, function calls) or streamed as the API's typed events.
Stored responses (`store`, on by default) keep their conversation for `previous_response_id`
in a bounded store: at most `MAX_STORED` responses, each for `STORE_TTL_S` seconds.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from orchard.cluster.gateway.chat_output import Answer, AnswerStream
from orchard.cluster.gateway.chat_serving import ChatRun, ChatServing
from orchard.cluster.gateway.errors import APIError, InvalidRequest
from orchard.cluster.gateway.protocol import ChatCompletionRequest
from orchard.cluster.gateway.responses_protocol import ResponsesRequest

MAX_STORED = 1024
STORE_TTL_S = 3600.0


class ResponseNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"

    def __init__(self, rid: str, param: str | None = None):
        super().__init__(f"No response with id {rid!r} is stored here (they are kept for {STORE_TTL_S:g} s).", param=param)


class ResponseStore:
    """Finished responses by id: their body and the conversation through them, bounded in count and age."""

    def __init__(self, max_entries: int = MAX_STORED, ttl_s: float = STORE_TTL_S, clock=time.monotonic):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._items: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()

    def put(self, rid: str, body: dict, conversation: list[dict]) -> None:
        self._items[rid] = (self.clock() + self.ttl_s, body, conversation)
        self._items.move_to_end(rid)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        entry = self._items.get(rid)
        if entry is None or entry[0] < self.clock():
            self._items.pop(rid, None)
            return None
        return entry[1], entry[2]


# ---- Responses request -> chat request ------------------------------------------------


def _input_messages(body: ResponsesRequest) -> list[dict]:
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for item in body.input:
        kind = item.type or "message"
        if kind == "message":
            media = [p.type for p in item.content if p.type.startswith("input_") and p.type != "input_text"] \
                if isinstance(item.content, list) else []
            if media:
                raise InvalidRequest(f"{media[0]} is not supported: the served model reads text only", param="input")
            out.append({"role": item.role, "content": item.text()})
        elif kind == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request, and the conversation it holds (without the instructions, which do not carry over)."""
    conversation = history + _input_messages(body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    choice = body.tool_choice
    data: dict[str, Any] = {
        "model": body.model, "messages": system + conversation, "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if hasattr(choice, "name") else choice,
        "prompt_cache_key": body.prompt_cache_key, "user": body.user,  # session keys (orchard/cluster/gateway/sessions.py)
    }
    if body.tools:
        data["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools]
    if body.reasoning and body.reasoning.effort:  # templates with a thinking switch think unless told "none"
        data["chat_template_kwargs"] = {"enable_thinking": body.reasoning.effort != "none"}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None}), conversation
    except Exception as exc:
        raise InvalidRequest(f"the request cannot be served: {exc}") from None


# ---- answers -> output items ----------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def output_items(answer: Answer) -> list[dict]:
    items = []
    if answer.reasoning:
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": answer.reasoning}]})
    if answer.content or not answer.calls:
        items.append(_message(_id("msg"), answer.content, "completed"))
    for call in answer.calls:
        items.append(_call(_id("fc"), _id("call"), call.name, call.arguments, "completed"))
    return items


def _message(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def assistant_turn(items: list[dict]) -> dict:
    """The output as the chat turn a later `previous_response_id` continues from."""
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(
        p["text"] for i in items if i["type"] == "message" for p in i["content"]) or None}
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


class ResponsesServing:
    def __init__(self, chats: ChatServing, store: ResponseStore):
        self.chats, self.store = chats, store

    def stored(self, rid: str) -> dict:
        found = self.store.get(rid)
        if found is None:
            raise ResponseNotFound(rid)
        return found[0]

    async def serve(self, body: ResponsesRequest, request: Request):
        history: list[dict] = []
        if body.previous_response_id is not None:
            found = self.store.get(body.previous_response_id)
            if found is None:
                raise ResponseNotFound(body.previous_response_id, param="previous_response_id")
            history = found[1]
        chat, conversation = chat_request(body, history)
        rid = _id("resp")
        run = await self.chats.prepare(chat, request, rid)
        if body.max_tool_calls is not None:
            run.reader.max_calls = min(run.reader.max_calls or body.max_tool_calls, body.max_tool_calls)
        shell = self._shell(body, rid, run)
        if body.stream:
            events = await run.gen.open_stream(run.jobs, run.params)
            return StreamingResponse(self._stream(run, events, shell, conversation), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        [answer] = await run.answers()
        return self._finish(shell, run, output_items(answer), conversation)

    def _shell(self, body: ResponsesRequest, rid: str, run: ChatRun) -> dict:
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": run.gen.info.name, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": (body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
            "store": body.store, "text": {"format": _format(body) or {"type": "text"}}, "truncation": "disabled",
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None}, "usage": None,
        }

    def _finish(self, shell: dict, run: ChatRun, items: list[dict], conversation: list[dict]) -> dict:
        state = run.choices.states[0]
        done = {**shell, "output": items, "status": "completed"}
        if state.finish_reason == "length":
            done.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        prompt = len(run.prompt_ids)
        done["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": state.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": prompt + state.num_tokens}
        if shell["store"]:
            self.store.put(shell["id"], done, [*conversation, assistant_turn(items)])
        return done

    async def _stream(self, run: ChatRun, events, shell: dict, conversation: list[dict]):
        out = _EventWriter()
        yield out.event("response.created", response=shell)
        yield out.event("response.in_progress", response=shell)
        stream, items = AnswerStream(run.reader), _Items(out)
        try:
            async for job, output in events:
                for _, c, text in run.add(job, output):
                    for frame in items.take(stream.update(text, final=c.finished)):
                        yield frame
        except Exception as exc:  # headers are sent: the stream is the only way left to tell
            from orchard.cluster.gateway.errors import as_api_error

            err = as_api_error(exc)
            yield out.event("error", code=err.code, message=err.message, param=err.param)
            return
        for frame in items.close():
            yield frame
        if not items.done:
            items.done.append(_message(_id("msg"), "", "completed"))
        done = self._finish(shell, run, items.done, conversation)
        yield out.event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)


class _EventWriter:
    def __init__(self):
        self.sequence = 0

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class _Items:
    """The output items of a streamed answer: one open at a time, each done when the next begins."""

    def __init__(self, out: _EventWriter):
        self.out = out
        self.done: list[dict] = []
        self.open: dict | None = None
        self.key: tuple | None = None
        self.text = ""

    def take(self, d):
        if d.reasoning:
            yield from self._switch(("reasoning",), {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []})
            yield self._delta("response.reasoning_text.delta", d.reasoning)
        if d.content:
            yield from self._switch(("message",), _message(_id("msg"), "", "in_progress"))
            yield self._delta("response.output_text.delta", d.content)
        for piece in d.tool_calls:
            if piece.id is not None:
                yield from self._switch(("call", piece.index), _call(_id("fc"), piece.id, piece.function.name, "", "in_progress"))
            if piece.function and piece.function.arguments:
                self.text += piece.function.arguments
                yield self.out.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.done), delta=piece.function.arguments)

    def _switch(self, key: tuple, item: dict):
        if key == self.key:
            return
        yield from self.close()
        self.open, self.key, self.text = item, key, ""
        yield self.out.event("response.output_item.added", output_index=len(self.done), item=item)
        if item["type"] == "message":
            yield self.out.event("response.content_part.added", item_id=item["id"], output_index=len(self.done),
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def _delta(self, kind: str, text: str) -> str:
        self.text += text
        return self.out.event(kind, item_id=self.open["id"], output_index=len(self.done), content_index=0, delta=text,
                              **({"logprobs": []} if kind == "response.output_text.delta" else {}))

    def close(self):
        item, index = self.open, len(self.done)
        if item is None:
            return
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            yield self.out.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=self.text)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item.update(status="completed", content=[part])
            yield self.out.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                 text=self.text, logprobs=[])
            yield self.out.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            item.update(status="completed", arguments=self.text)
            yield self.out.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=self.text)
        yield self.out.event("response.output_item.done", output_index=index, item=item)
        self.done.append(item)
        self.open = self.key = None


def install_responses_api(app: FastAPI, chats: ChatServing, auth: list, errors: dict) -> None:
    responses = ResponsesServing(chats, ResponseStore())

    @app.post("/v1/responses", dependencies=auth, responses=errors)
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.serve(body, request)

    @app.get("/v1/responses/{response_id}", dependencies=auth, responses=errors)
    async def get_response(response_id: str):
        return responses.stored(response_id)
