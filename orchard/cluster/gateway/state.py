"""What the routes share: the backend, the operator's config, the metrics, and admission.

Both endpoints (`serving.py`) and the app (`app.py`) read it; it reads neither.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import Request

from orchard.cluster.gateway.backend import Backend, ModelInfo
from orchard.cluster.gateway.chat_output import ChatFormat
from orchard.cluster.gateway.errors import ModelNotFound, QueueFull, ServiceUnavailable
from orchard.cluster.gateway.guard import DEFAULT_MAX_BODY_BYTES, check_api_keys
from orchard.cluster.gateway.jobs import Generation
from orchard.cluster.gateway.metrics import GatewayMetrics
from orchard.cluster.gateway.reasoning import reasoning_parser_named
from orchard.cluster.gateway.tool_parsers import parser_named

log = logging.getLogger("orchard.gateway")


@dataclass
class GatewayConfig:
    """What the operator decides about the HTTP front; the model's limits come from the backend."""

    api_keys: frozenset[str] = field(default_factory=frozenset)
    max_queue: int = 1024  # requests waiting for their first token before new ones get 429
    retry_after_s: int = 1
    request_timeout_s: float | None = 600.0
    max_chat_tokens: int | None = None  # chat's default max_tokens; None: the rest of the context
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 before they are read
    tool_call_parser: str | None = None  # vLLM's names; None: chosen from each model's chat template
    reasoning_parser: str | None = None
    history_every_s: float = 0.0  # the dashboard's charts sampled this often from start up; 0: only while viewed

    def __post_init__(self) -> None:
        check_api_keys(self.api_keys)  # WeakApiKey: no server starts with a guessable key
        if self.tool_call_parser is not None:
            parser_named(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            reasoning_parser_named(self.reasoning_parser)


class Admission:
    """Queue places held by one HTTP request's jobs, each given back once (first output or end)."""

    def __init__(self, gateway: Gateway, places: int):
        self._gateway, self._held = gateway, places

    def release(self, places: int = 1) -> None:
        places = min(places, self._held)
        self._held -= places
        self._gateway.waiting -= places

    def release_all(self) -> None:
        self.release(self._held)


class Gateway:
    """The state the routes share: backend, config, metrics, and the admission checks."""

    def __init__(self, backend: Backend, config: GatewayConfig):
        self.backend = backend
        self.config = config
        self.metrics = GatewayMetrics()
        self.waiting = 0  # admitted jobs that have not produced their first output yet
        self._formats: dict[int, ChatFormat] = {}

    def chat_format(self, info: ModelInfo) -> ChatFormat:
        """How `info`'s answers read, worked out once per tokenizer (its template is fixed)."""
        key = id(info.tokenizer)
        if key not in self._formats:
            self._formats[key] = ChatFormat.of(info.tokenizer, self.config.tool_call_parser, self.config.reasoning_parser)
        return self._formats[key]

    async def model(self, name: str) -> ModelInfo:
        if not await self.backend.ready():
            raise ServiceUnavailable("No node is ready to serve yet; retry shortly.")
        served = await self.backend.models()
        for info in served:
            if info.name == name:
                return info
        raise ModelNotFound(name, [m.name for m in served])

    def admit(self, new_requests: int) -> Admission:
        """Take `new_requests` places in the queue or raise QueueFull. Counting and taking
        happen with no await between them, so a burst cannot pass the limit."""
        if self.waiting + new_requests > self.config.max_queue:
            raise QueueFull(self.waiting, self.config.max_queue, self.config.retry_after_s)
        self.waiting += new_requests
        return Admission(self, new_requests)

    async def cluster_snapshot(self) -> dict:
        """The backend's cluster view, or ServiceUnavailable when it cannot give one."""
        if not await self.backend.ready():
            raise ServiceUnavailable("No node is ready yet; the cluster has nothing to report.")
        try:
            return await self.backend.cluster_info()
        except Exception as exc:  # a coordinator that is restarting or unreachable
            log.warning("cluster info unavailable: %s", exc)
            raise ServiceUnavailable("The cluster's state is unavailable right now; retry shortly.") from exc

    def generation(self, info: ModelInfo, request: Request, admission: Admission) -> Generation:
        return Generation(self.backend, info, request, self.metrics, self.config.request_timeout_s, admission)
