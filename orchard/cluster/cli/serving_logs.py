"""What `orchard serve` says while serving, and the names it serves under.

`RequestLog` wraps the gateway's ASGI app: one access line per request (method, path,
status, duration, request id) and an `x-request-id` on every response, the client's own
when it sent one. `ServedBackend` wraps the backend: the `--served-model-name` names and
the `--chat-template` over the model's, and the token counts behind `StatsLine`, which logs
throughput, running/waiting, KV use and prefix hit rate every few seconds while there is
traffic, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import replace
from typing import Any

access_log = logging.getLogger("orchard.access")
stats_log = logging.getLogger("orchard.stats")

REQUEST_ID_HEADER = b"x-request-id"
_CLIENT_ID = re.compile(rb"^[\x21-\x7e]{1,128}$")  # printable, no spaces: safe to log and echo


class RequestLog:
    """ASGI middleware: an access log line and an `x-request-id` for every HTTP request."""

    def __init__(self, app):
        self.app = app

    def __getattr__(self, name: str) -> Any:  # `state`, `routes`... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER)
        request_id = given if given and _CLIENT_ID.match(given) else uuid.uuid4().hex.encode()
        started = time.perf_counter()
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            access_log.info('%s "%s %s" %d %.3fs request_id=%s', peer, scope["method"], scope["path"], status[0],
                            time.perf_counter() - started, request_id.decode())


def apply_chat_template(tokenizer: Any, template: str) -> None:
    """Make `tokenizer` (mlx-lm's TokenizerWrapper or a Hugging Face tokenizer) render `template`."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(inner, "chat_template", None) == template:
        return
    inner.chat_template = template
    if inner is not tokenizer:
        # TokenizerWrapper forwards attribute writes to the inner tokenizer; these are its own.
        tokenizer.__dict__["has_chat_template"] = True
        tokenizer.__dict__["_chat_template"] = None


class ServedBackend:
    """The backend under the names the operator chose, counting the tokens that pass."""

    def __init__(self, backend, names: list[str] | None = None, chat_template: str | None = None):
        self.inner = backend
        self.names = list(dict.fromkeys(names or []))
        self.chat_template = chat_template
        self._real: dict[str, str] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def models(self) -> list:
        served = await self.inner.models()
        if self.chat_template is not None:
            for info in served:
                apply_chat_template(info.tokenizer, self.chat_template)
        if not self.names or not served:
            return served
        real = served[0]
        self._real = {name: real.name for name in self.names}
        return [replace(real, name=name) for name in self.names]

    async def generate(self, request_id: str, model: str, prompt_token_ids: list[int], params, session=None):
        self.waiting += 1
        self.prompt_tokens += len(prompt_token_ids)
        first = True
        try:
            async for output in self.inner.generate(request_id, self._real.get(model, model), prompt_token_ids, params, session):
                if first:
                    self.waiting -= 1
                    self.running += 1
                    first = False
                self.generation_tokens += sum(len(o.token_ids_delta) for o in output.outputs)
                yield output
        finally:
            if first:
                self.waiting -= 1
            else:
                self.running -= 1

    async def cluster_info(self) -> dict:
        info = await self.inner.cluster_info()
        if self.names:
            info = {**info, "model": self.names[0]}
        return info


class StatsLine:
    """Every `every_s` seconds while there is traffic, one line of serving figures."""

    def __init__(self, backend: ServedBackend, every_s: float):
        self.backend = backend
        self.every_s = every_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if isinstance(self.backend, ServedBackend) and self.every_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        b = self.backend
        last = (b.prompt_tokens, b.generation_tokens, time.monotonic())
        while True:
            await asyncio.sleep(self.every_s)
            now = (b.prompt_tokens, b.generation_tokens, time.monotonic())
            busy = b.running or b.waiting or now[:2] != last[:2]
            if busy:
                with contextlib.suppress(Exception):  # a stats line is never worth an error
                    stats_log.info("%s", await self.line(last, now))
            last = now

    async def line(self, last, now) -> str:
        elapsed = max(now[2] - last[2], 1e-9)
        kv_use = hit_rate = 0.0
        with contextlib.suppress(Exception):
            info = await self.backend.cluster_info()
            total = info.get("kv_blocks_total") or 0
            kv_use = info.get("kv_blocks_used", 0) / total if total else 0.0
            hit_rate = info.get("prefix_cache_hit_rate", 0.0)
        return (f"Avg prompt throughput: {(now[0] - last[0]) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(now[1] - last[1]) / elapsed:.1f} tokens/s, "
                f"Running: {self.backend.running} reqs, Waiting: {self.backend.waiting} reqs, "
                f"KV cache usage: {kv_use:.1%}, Prefix cache hit rate: {hit_rate:.1%}")
