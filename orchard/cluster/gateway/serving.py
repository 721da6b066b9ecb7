"""From a validated OpenAI request to engine jobs, and from engine outputs back to OpenAI.

Both endpoints (completions here, chat in `chat_serving`) share the same steps: resolve
the model, tokenize, check the context and the queue, build `SamplingParams`, run the jobs
(`jobs.Generation`), then either collect the choices into one response or render each
output as a server-sent event.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from orchard.cluster.gateway.backend import ModelInfo
from orchard.cluster.gateway.errors import APIError, ContextLengthExceeded, InvalidRequest, as_api_error
from orchard.cluster.gateway.jobs import Job
from orchard.cluster.gateway.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from orchard.cluster.gateway.sessions import session_key
from orchard.cluster.gateway.state import Gateway
from orchard.cluster.gateway.structured import constraint_for
from orchard.node.errors import PromptTooLong
from orchard.node.types import RequestOutput, SamplingParams, TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI reports impossible tokens with this value
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_SEQUENCES_PER_REQUEST = 128
INLINE_PROMPT_CHARS = 2048  # longer text prompts are tokenized on a worker thread


# ---- accumulating choices -------------------------------------------------------------


@dataclass
class ChoiceState:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Choices:
    """Every choice of a request: job j's continuation i is choice `j * n + i`."""

    def __init__(self, n: int, num_jobs: int):
        self.n = n
        self.states = [ChoiceState() for _ in range(n * num_jobs)]
        self.cached_tokens = [0] * num_jobs  # each prompt's tokens the engine found in its prefix cache

    def index(self, job: int, completion_index: int) -> int:
        return job * self.n + completion_index

    def add(self, job: int, out: RequestOutput) -> None:
        self.cached_tokens[job] = max(self.cached_tokens[job], out.num_cached_tokens or 0)
        for c in out.outputs:
            state = self.states[self.index(job, c.index)]
            state.text = c.text
            state.num_tokens = len(c.token_ids)
            state.logprobs.extend(c.logprobs_delta)
            state.finish_reason = c.finish_reason or state.finish_reason

    def usage(self, prompts: list[list[int]]) -> Usage:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(s.num_tokens for s in self.states)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))


class TokenText:
    """Text of single tokens, for logprobs; cached since the same ids recur."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in entries:
        token = text(entry.token_id)
        top = {text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(token, _finite(entry.logprob))
        result.tokens.append(token)
        result.token_logprobs.append(_finite(entry.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(entries: list[TokenLogprob], text: TokenText, k: int) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = text(token_id)
        return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))

    content = []
    for entry in entries:
        head = top(entry.token_id, entry.logprob)
        alternatives = [top(t, lp) for t, lp in entry.top[:k]]
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


# ---- request preparation shared by both endpoints -------------------------------------


def _vocab_size(info: ModelInfo) -> int | None:
    if info.vocab_size is not None:
        return info.vocab_size
    tok = info.tokenizer
    for probe in (lambda: len(tok), lambda: len(tok.get_vocab()), lambda: int(tok.vocab_size)):
        try:
            return probe()
        except (TypeError, AttributeError, ValueError):
            continue
    return None


def tokenized_inline(prompt: Any) -> bool:
    """Whether a completion's prompt is cheaper to tokenize on the event loop than on a thread: token
    ids, or text of at most `INLINE_PROMPT_CHARS` in all. The hop to a worker thread and back took
    0.2 ms of a request's TTFT on two cores (docs/benchmarks.md, "Outputs sent by the engine thread")."""
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_PROMPT_CHARS
    if all(isinstance(p, str) for p in prompt):
        return sum(map(len, prompt)) <= INLINE_PROMPT_CHARS
    return True


def check_token_ids(ids: list[int], info: ModelInfo) -> None:
    vocab = _vocab_size(info)
    if vocab is not None and ids and max(ids) >= vocab:
        raise InvalidRequest(f"token id {max(ids)} is outside the model's vocabulary of {vocab} tokens", param="prompt")


def token_budget(prompt_len: int, asked: int | None, default: int | None, info: ModelInfo, param: str) -> int:
    """max_tokens for one prompt: what was asked if it fits, else ContextLengthExceeded."""
    room = info.max_model_len - prompt_len
    if room < 1:
        raise ContextLengthExceeded(str(PromptTooLong(prompt_len, info.max_model_len)), param=param)
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {info.max_model_len} tokens, but {prompt_len + asked} "
            f"were requested ({prompt_len} in the prompt, {asked} for the completion).",
            param=param,
        )
    return asked


def sampling_params(body: Any, max_tokens: int, logprobs: int | None, stop: list[str], stop_token_ids: list[int]) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        stop=stop,
        stop_token_ids=stop_token_ids + list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        n=body.n,
        constraint=constraint_for(body),  # refused earlier if it cannot be enforced; compiled once (cached)
    )


def check_stream_options(body: Any) -> None:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(json.dumps(as_api_error(exc).body()))


SSE_DONE = sse("[DONE]")


class _Serving:
    """What both endpoints share: admission, running, streaming frame."""

    id_prefix = "cmpl"

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def streaming_response(self, frames: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def frames(self, events: AsyncIterator[tuple[int, RequestOutput]], render) -> AsyncIterator[str]:
        """SSE frames: whatever `render` makes of each output; an error event if one occurs."""
        try:
            async for i, out in events:
                for frame in render(i, out):
                    yield frame
        except APIError as exc:
            yield sse_error(exc)
        except Exception as exc:  # headers are sent: the stream is the only way left to tell
            yield sse_error(exc)


class CompletionServing(_Serving):
    id_prefix = "cmpl"

    def prompts(self, body: CompletionRequest, info: ModelInfo) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            texts = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        elif all(isinstance(p, int) for p in prompt):
            texts, ids_list = None, [list(prompt)]
        else:
            texts, ids_list = None, [list(p) for p in prompt]
        if texts is not None:
            ids_list = [list(info.tokenizer.encode(t)) for t in texts]
        for ids in ids_list:
            if not ids:
                raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
            check_token_ids(ids, info)
        return ids_list

    async def serve(self, body: CompletionRequest, request: Request):
        gw = self.gateway
        check_stream_options(body)
        constraint_for(body)  # the structured-output work hands its result to SamplingParams
        info = await gw.model(body.model)
        if tokenized_inline(body.prompt):
            prompts = self.prompts(body, info)
        else:  # a long prompt must not stall other requests
            prompts = await asyncio.to_thread(self.prompts, body, info)
        if len(prompts) * body.n > MAX_SEQUENCES_PER_REQUEST:
            raise InvalidRequest(f"n times the number of prompts may be at most {MAX_SEQUENCES_PER_REQUEST}", param="n")
        budgets = [token_budget(len(p), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, info, "prompt") for p in prompts]
        params = sampling_params(body, min(budgets), body.logprobs, body.stop_list(), [])
        rid = self.new_id()
        session = session_key(request, body)
        jobs = [Job(f"{rid}-{i}", ids, session) for i, ids in enumerate(prompts)]
        gen = gw.generation(info, request, gw.admit(len(prompts)))
        choices = Choices(body.n, len(jobs))
        text = TokenText(info.tokenizer)
        if body.stream:
            events = await gen.open_stream(jobs, params)
            return self.streaming_response(self._stream(gen, events, body, rid, prompts, choices, text))
        await gen.collect(jobs, params, choices.add)
        echoed = self.echoed(body, prompts, info)
        return CompletionResponse(
            id=rid, model=info.name, usage=choices.usage(prompts),
            choices=[
                CompletionChoice(
                    index=i, text=echoed[i // body.n] + s.text, finish_reason=s.finish_reason,
                    logprobs=None if body.logprobs is None else completion_logprobs(s.logprobs, text, 0),
                )
                for i, s in enumerate(choices.states)
            ],
        )

    def echoed(self, body: CompletionRequest, prompts: list[list[int]], info: ModelInfo) -> list[str]:
        """Each prompt's text when `echo` asks for it before its completions, else ""."""
        if not body.echo:
            return [""] * len(prompts)
        if isinstance(body.prompt, str) or all(isinstance(p, str) for p in body.prompt):
            return [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        return [info.tokenizer.decode(p) for p in prompts]

    async def _stream(self, gen, events, body, rid, prompts, choices: Choices, text: TokenText):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}
        created = int(time.time())
        for i, echo in enumerate(self.echoed(body, prompts, gen.info)):
            for k in range(body.n) if echo else ():
                chunk = CompletionResponse(id=rid, created=created, model=gen.info.name,
                                           choices=[CompletionChoice(index=i * body.n + k, text=echo)])
                yield sse(chunk.model_dump_json(exclude=exclude))

        def render(job: int, out: RequestOutput):
            for c in out.outputs:
                if not (c.token_ids_delta or c.text_delta or c.finished):
                    continue
                index = choices.index(job, c.index)
                offset = max(len(choices.states[index].text) - len(c.text_delta), 0)
                logprobs = None if body.logprobs is None else completion_logprobs(c.logprobs_delta, text, offset)
                choice = CompletionChoice(index=index, text=c.text_delta, logprobs=logprobs, finish_reason=c.finish_reason)
                chunk = CompletionResponse(id=rid, created=created, model=gen.info.name, choices=[choice])
                yield sse(chunk.model_dump_json(exclude=exclude))

        def render_tracked(job: int, out: RequestOutput):
            choices.add(job, out)
            yield from render(job, out)

        async for frame in self.frames(events, render_tracked):
            yield frame
        if include_usage:
            final = CompletionResponse(id=rid, created=created, model=gen.info.name, choices=[], usage=choices.usage(prompts))
            yield sse(final.model_dump_json())
        yield SSE_DONE
