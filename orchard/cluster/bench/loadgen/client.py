"""One streamed request to an OpenAI-compatible endpoint, timed token by token.

The client reads the server-sent events itself (no SDK) so that every timestamp is
taken when the bytes arrive. Token counts come from the `usage` object of the final
chunk when the server sends one (asked for with `stream_options.include_usage`);
otherwise each chunk carrying text counts as one token, which undercounts servers that
pack several tokens per chunk. Failures become a record with an error, never an
exception, so one bad request does not end a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class EndpointConfig:
    """Where to send requests and the sampling settings every request shares."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = False

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Outgoing:
    """A request ready to send: a prompt (completions) or messages (chat)."""

    conversation_id: int
    turn: int
    input_tokens: int
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


@dataclass
class RequestRecord:
    """What one request measured; times in seconds, `start_s` from the run's start."""

    conversation_id: int
    turn: int
    start_s: float
    input_tokens: int
    max_tokens: int
    prompt_tokens: int | None = None
    output_tokens: int = 0
    content_chunks: int = 0
    token_source: str = "chunks"
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; undefined for one token."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


class StreamClient:
    """Sends `Outgoing` requests over one shared `httpx.AsyncClient`."""

    def __init__(self, endpoint: EndpointConfig, http: httpx.AsyncClient) -> None:
        self.endpoint = endpoint
        self.http = http

    def body(self, req: Outgoing) -> dict:
        body: dict = {
            "max_tokens": req.max_tokens,
            "temperature": self.endpoint.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint.model:
            body["model"] = self.endpoint.model
        if self.endpoint.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None:
            body["messages"] = list(req.messages)
        else:
            body["prompt"] = req.prompt
        return body

    async def send(self, req: Outgoing, run_start: float) -> RequestRecord:
        t0 = time.perf_counter()
        rec = RequestRecord(req.conversation_id, req.turn, t0 - run_start, req.input_tokens, req.max_tokens)
        url = self.endpoint.base_url.rstrip("/") + req.path
        try:
            async with self.http.stream("POST", url, json=self.body(req), headers=self.endpoint.headers()) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                    rec.error = f"HTTP {resp.status_code}: {detail}"
                    return rec
                await _read_events(resp, rec, t0)
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        if rec.error is None:
            rec.e2el_s = time.perf_counter() - t0
        return rec


async def _read_events(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    last = t0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ': keepalive' comments
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        text = chunk_text(chunk)
        if text:
            now = time.perf_counter()
            if rec.ttft_s is None:
                rec.ttft_s = now - t0
            else:
                rec.itl_s.append(now - last)
            last = now
            rec.content_chunks += 1
            rec.text += text
        if chunk.get("usage"):
            rec.prompt_tokens = chunk["usage"].get("prompt_tokens")
            rec.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
            rec.token_source = "usage"
    if rec.token_source == "chunks":
        rec.output_tokens = rec.content_chunks


def chunk_text(chunk: dict) -> str:
    """Text a completions or chat chunk carries (reasoning text counts as output)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "text" in first:
        return first.get("text") or ""
    delta = first.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
