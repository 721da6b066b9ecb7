"""The OpenAI-compatible HTTP front: `create_app(backend, config)` builds the FastAPI app.

Handlers here only route; the shared state and admission live in `state`, generation
belongs to the `Backend`, wire shapes to `protocol`, statuses to `errors`, and the turning
of engine outputs into OpenAI responses to `serving`. Every route is declared with its
response model and its error responses so /openapi.json states what the server does.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic.json_schema import models_json_schema

from orchard.cluster.gateway.backend import Backend
from orchard.cluster.gateway.chat_serving import ChatServing
from orchard.cluster.gateway.dashboard import install_dashboard
from orchard.cluster.gateway.errors import (
    ServiceUnavailable,
    ShuttingDown,
    Unauthorized,
    declared_errors,
    install_error_handlers,
)
from orchard.cluster.gateway.guard import RequestGuard
from orchard.cluster.gateway.messages_api import MESSAGES_PATH, install_messages_api
from orchard.cluster.gateway.messages_api import OPENAPI_MODELS as MESSAGES_OPENAPI_MODELS
from orchard.cluster.gateway.messages_api import refusal_response as messages_refusal
from orchard.cluster.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from orchard.cluster.gateway.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClusterInfo,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from orchard.cluster.gateway.responses_api import install_responses_api
from orchard.cluster.gateway.serving import SSE_DONE, CompletionServing, sse_error
from orchard.cluster.gateway.state import Gateway, GatewayConfig
from orchard.cluster.gateway.utility_api import install_utility_api


def _sse_doc(chunk_model: type) -> dict:
    """One server-sent event of a stream: a chunk, an error, or the final `[DONE]`."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk_model.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"type": "string", "anyOf": [{"const": "[DONE]"}, {"contentMediaType": "application/json", "contentSchema": payload}]}
    event = {
        "type": "object", "required": ["data"], "properties": {"data": data},
        "description": "with `stream: true`, each `data:` event holds a chunk (or an error); the last is `[DONE]`",
    }
    return {"text/event-stream": {"schema": event}}


#: Models that appear only inside event streams, so FastAPI would not list them itself.
_STREAM_ONLY_MODELS = (ChatCompletionChunk, ErrorResponse)


def _bearer_check(keys: frozenset[str]):
    scheme = HTTPBearer(auto_error=False, description="one of the server's API keys")

    async def require_key(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if credentials is None or credentials.credentials not in keys:
            raise Unauthorized()

    return require_key


def _truthful_openapi(app: FastAPI) -> None:
    """FastAPI declares 422 for validation; this server answers 400, so say so. It also
    lists the stream-only models that the event-stream schemas refer to."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _, extra = models_json_schema(
                [(m, "serialization") for m in _STREAM_ONLY_MODELS] + MESSAGES_OPENAPI_MODELS,
                ref_template="#/components/schemas/{model}",
            )
            for name, definition in extra.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class _CountRequests:
    """ASGI middleware counting answered requests by endpoint and status (streams included)."""

    def __init__(self, app, metrics: GatewayMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope.get("path", "")
            self.metrics.count_request(path if path in self.endpoints else "other", status)


class _EndCutStreams:
    """ASGI middleware: an event stream cancelled from outside (uvicorn does so to every
    request still running when `--grace` ends) closes with an error event and `[DONE]`,
    so that a client can tell a cut stream from a finished one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        streaming = ended = False

        async def send_watched(message):
            nonlocal streaming, ended
            if message["type"] == "http.response.start":
                streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except asyncio.CancelledError:
            if streaming and not ended:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    tail = (sse_error(ShuttingDown()) + SSE_DONE).encode()
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
            raise


def create_app(backend: Backend, config: GatewayConfig | None = None) -> FastAPI:
    config = config or GatewayConfig()
    gw = Gateway(backend, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await backend.shutdown()

    app = FastAPI(
        title="mlx-orchard",
        version="0.1.0",
        description="OpenAI-compatible endpoint over a cluster of MLX engines.",
        lifespan=lifespan,
    )
    app.state.gateway = gw
    install_error_handlers(app)
    auth = [Depends(_bearer_check(config.api_keys))] if config.api_keys else []
    auth_errors = (401,) if config.api_keys else ()
    generation_errors = declared_errors(400, *auth_errors, 404, 413, 429, 503, 504)
    completions, chats = CompletionServing(gw), ChatServing(gw)

    @app.post(
        "/v1/completions", response_model=CompletionResponse, dependencies=auth,
        responses={200: {"content": _sse_doc(CompletionResponse)}, **generation_errors},
    )
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.serve(body, request)

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=auth,
        responses={200: {"content": _sse_doc(ChatCompletionChunk)}, **generation_errors},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chats.serve(body, request)

    @app.get("/v1/models", response_model=ModelList, dependencies=auth, responses=declared_errors(*auth_errors))
    async def list_models() -> ModelList:
        served = await backend.models() if await backend.ready() else []
        return ModelList(data=[ModelCard(id=m.name, max_model_len=m.max_model_len) for m in served])

    @app.get("/v1/cluster", response_model=ClusterInfo, dependencies=auth, responses=declared_errors(*auth_errors, 503))
    async def cluster_info() -> ClusterInfo:
        return ClusterInfo.model_validate(await gw.cluster_snapshot())

    @app.get(
        "/health", response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "no model ready yet"}},
    )
    async def health():
        if await backend.ready():
            return HealthResponse(status="ok")
        return JSONResponse(HealthResponse(status="starting").model_dump(), status_code=503)

    @app.get(
        "/metrics", response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}, "description": "Prometheus text format"}},
    )
    async def metrics() -> Response:
        try:
            info = await gw.cluster_snapshot()
        except ServiceUnavailable:
            info = {"nodes": [], "queue_depth": 0}  # the gateway's own figures still count
        return Response(gw.metrics.render(info), media_type=CONTENT_TYPE)

    install_messages_api(app, chats, config.api_keys)
    install_responses_api(app, chats, auth, generation_errors)
    install_dashboard(app, gw, auth, declared_errors(*auth_errors, 503))
    install_utility_api(app, gw, chats, auth, declared_errors(400, *auth_errors, 404, 503))
    _truthful_openapi(app)
    endpoints = {route.path for route in app.routes}
    app.add_middleware(_EndCutStreams)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes, api_keys=config.api_keys,
                       renderers={MESSAGES_PATH: messages_refusal})
    app.add_middleware(_CountRequests, metrics=gw.metrics, endpoints=endpoints)  # outermost: counts refusals too
    return app

