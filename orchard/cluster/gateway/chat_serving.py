"""/v1/chat/completions: from a validated chat request to engine jobs, and back to OpenAI.

The request becomes the template's input (messages with their earlier calls, the tools
offered, template variables), then one job; each choice's answer is read by the model's
`ChatFormat` into reasoning, content and tool calls, whole or as stream deltas.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from orchard.cluster.gateway.backend import ModelInfo
from orchard.cluster.gateway.chat_output import Answer, AnswerReader, AnswerStream, AnswerText, ChatFormat, finish_reason
from orchard.cluster.gateway.chat_template import ChatPrompt, build_chat_prompt
from orchard.cluster.gateway.errors import InvalidRequest
from orchard.cluster.gateway.jobs import Generation, Job
from orchard.cluster.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
)
from orchard.cluster.gateway.serving import (
    SSE_DONE,
    Choices,
    TokenText,
    _Serving,
    chat_logprobs,
    check_stream_options,
    sampling_params,
    sse,
    token_budget,
)
from orchard.cluster.gateway.sessions import session_key
from orchard.cluster.gateway.structured import constraint_for
from orchard.cluster.gateway.tool_calls import (
    allowed_calls,
    check_tool_choice,
    forced_parser,
    template_arguments,
    template_tools,
    tool_call,
    tools_offered,
)
from orchard.node.types import CompletionOutput, RequestOutput, SamplingParams

#: Arguments of `apply_chat_template` itself, which template variables may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see whether the template opened a think block


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The conversation as Hugging Face templates take it."""
    out = []
    for m in body.messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            entry["reasoning_content"] = m.reasoning_content
        out.append(entry)
    return out


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(k for k in kwargs if not k.isidentifier() or k in RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


@dataclass
class ChatRun:
    """One chat request made ready to run: its job, parameters, and how its answers read.
    The OpenAI endpoint and the Anthropic one (`messages_api`) both run chats through it."""

    gen: Generation
    jobs: list[Job]
    params: SamplingParams
    reader: AnswerReader
    texts: list[AnswerText]  # one per choice
    choices: Choices
    stop_reasons: dict[int, str | int | None] = field(default_factory=dict)  # by choice, once finished

    @property
    def prompt_ids(self) -> list[int]:
        return self.jobs[0].prompt_token_ids

    def add(self, job: int, out: RequestOutput) -> list[tuple[int, CompletionOutput, str]]:
        """Take one output in; (choice index, its completion, its answer text so far) for each."""
        self.choices.add(job, out)
        for c in out.outputs:
            if c.finished:
                self.stop_reasons[self.choices.index(job, c.index)] = c.stop_reason
        return [(self.choices.index(job, c.index), c, self.texts[c.index].update(c)) for c in out.outputs]

    async def answers(self) -> list[Answer]:
        """Run to the end; each choice's whole answer, read."""
        texts = [""] * len(self.texts)

        def add(job: int, out: RequestOutput) -> None:
            for index, _, text in self.add(job, out):
                texts[index] = text

        await self.gen.collect(self.jobs, self.params, add)
        return [self.reader.read(t, final=True, whole=True) for t in texts]


class ChatServing(_Serving):
    id_prefix = "chatcmpl"

    async def prompt(self, body: ChatCompletionRequest) -> tuple[ModelInfo, ChatFormat, bool, ChatPrompt]:
        """The request checked and templated: its model, that model's format, whether tools are offered, the prompt."""
        gw = self.gateway
        check_stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        check_tool_choice(body)
        constraint_for(body)  # refuses what cannot be enforced before any work; sampling_params carries it
        info = await gw.model(body.model)
        fmt = gw.chat_format(info)
        tools = tools_offered(body)
        if tools and fmt.tool_parser is None and forced_parser(body) is None:
            raise InvalidRequest("this model's tool-call format is not known: the server must be started with "
                                 "--tool-call-parser NAME to take tools", param="tools")
        messages, kwargs = template_messages(body), template_kwargs(body)
        prompt = await asyncio.to_thread(build_chat_prompt, info.tokenizer, messages, template_tools(tools), kwargs)
        return info, fmt, bool(tools), prompt

    async def prepare(self, body: ChatCompletionRequest, request: Request, rid: str) -> ChatRun:
        gw = self.gateway
        info, fmt, tools, prompt = await self.prompt(body)
        max_tokens = token_budget(len(prompt.token_ids), body.token_limit(), gw.config.max_chat_tokens, info, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs, body.stop_list() + prompt.stop, prompt.stop_token_ids)
        tail = info.tokenizer.decode(prompt.token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False) if fmt.reasoning_parser else ""
        reader = AnswerReader(fmt, tools, tail, allowed_calls(body), forced_parser(body),
                              template_tools(tools_offered(body)))
        hidden = set(getattr(info.tokenizer, "eos_token_ids", None) or []) | set(params.stop_token_ids)
        texts = [AnswerText(info.tokenizer, prompt.token_ids, hidden, reader.needs_special_tokens) for _ in range(body.n)]
        gen = gw.generation(info, request, gw.admit(1))
        return ChatRun(gen, [Job(rid, prompt.token_ids, session_key(request, body))], params, reader, texts, Choices(body.n, 1))

    async def serve(self, body: ChatCompletionRequest, request: Request):
        rid = self.new_id()
        run = await self.prepare(body, request, rid)
        text = TokenText(run.gen.info.tokenizer)
        if body.stream:
            events = await run.gen.open_stream(run.jobs, run.params)
            return self.streaming_response(self._stream(run, events, body, rid, text))
        answers = await run.answers()
        return ChatCompletionResponse(
            id=rid, model=run.gen.info.name, usage=run.choices.usage([run.prompt_ids]),
            choices=[self._choice(i, s, answers[i], body, text) for i, s in enumerate(run.choices.states)],
        )

    def _choice(self, index: int, state, answer: Answer, body: ChatCompletionRequest, text: TokenText) -> ChatChoice:
        calls = [tool_call(c.name, c.arguments) for c in answer.calls]
        message = AssistantMessage(content=None if calls and not answer.content else answer.content,
                                   tool_calls=calls or None, reasoning_content=answer.reasoning or None)
        return ChatChoice(index=index, message=message, finish_reason=finish_reason(state.finish_reason, bool(calls)),
                          logprobs=chat_logprobs(state.logprobs, text, body.top_logprobs or 0) if body.logprobs else None)

    async def _stream(self, run: ChatRun, events, body, rid, text: TokenText):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}
        created = int(time.time())
        k = body.top_logprobs or 0
        name = run.gen.info.name
        streams = [AnswerStream(run.reader) for _ in run.texts]

        def chunk(choice: ChatChunkChoice) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice]).model_dump_json(exclude=exclude))

        for index in range(len(run.choices.states)):
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))

        def render(job: int, out: RequestOutput):
            for index, c, answer in run.add(job, out):
                if not (c.token_ids_delta or c.text_delta or c.finished):
                    continue
                d = streams[index].update(answer, final=c.finished)
                quiet = d.reasoning or d.tool_calls or c.finished
                delta = ChatDelta(content=d.content or (None if quiet else ""), reasoning_content=d.reasoning or None,
                                  tool_calls=d.tool_calls or None)
                logprobs = chat_logprobs(c.logprobs_delta, text, k) if body.logprobs else None
                reason = finish_reason(c.finish_reason, streams[index].called)
                yield chunk(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason))

        async for frame in self.frames(events, render):
            yield frame
        if include_usage:
            usage = run.choices.usage([run.prompt_ids])
            yield sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage).model_dump_json())
        yield SSE_DONE
