"""The one place where exceptions become HTTP statuses, always in OpenAI's error shape.

Code anywhere in the gateway raises a named `APIError` subclass (or lets a node's typed
error escape); `install_error_handlers` turns each into `{"error": {...}}` with the right
status. FastAPI's validation errors become 400 naming the parameter, as OpenAI answers,
never 422; an unexpected exception becomes a 500 that says nothing about internals.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchard.cluster.gateway.chat_template import ChatTemplateError
from orchard.cluster.gateway.protocol import ErrorResponse
from orchard.node.errors import InvalidPrompt, InvalidSamplingParams, PromptTooLong

log = logging.getLogger("orchard.gateway")


class APIError(Exception):
    """An error with its HTTP status and OpenAI's `type`, `param` and `code` fields."""

    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (the engine's `PromptTooLong`), or the prompt plus the tokens asked for, exceeds the context."""

    code = "context_length_exceeded"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Missing or invalid API key: send 'Authorization: Bearer <key>'."):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]):
        super().__init__(f"The model '{model}' does not exist; this server serves {available}.", param="model")


class ModelNotServed(APIError):
    """The model was known but no node serves it any more."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, message: str):
        super().__init__(message, param="model")


class RequestTimedOut(APIError):
    """504, with `x-should-retry: false`: OpenAI's SDKs retry 408 and every 5xx unless that
    header says not to, and the same request would only run past the same limit again."""

    status = 504
    type = "timeout_error"
    code = "request_timeout"

    def __init__(self, seconds: float):
        super().__init__(
            f"The request did not finish within the server's limit of {seconds:g} s and was aborted; "
            "ask for fewer tokens rather than retrying it as it is.",
            headers={"x-should-retry": "false"},
        )


class ClientClosedRequest(APIError):
    """The client went away before its answer was ready; nobody reads this response."""

    status = 499
    type = "client_closed_request"

    def __init__(self):
        super().__init__("The client closed the connection; the request was aborted.")


class QueueFull(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, depth: int, limit: int, retry_after_s: int):
        super().__init__(
            f"The server's queue holds {depth} requests, its limit is {limit}; retry after {retry_after_s} s.",
            headers={"Retry-After": str(retry_after_s)},
        )


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable_error"
    code = "no_node_ready"


class ShuttingDown(APIError):
    """A stream still running when the server's drain time (`--grace`) ran out."""

    status = 503
    type = "service_unavailable_error"
    code = "server_shutting_down"

    def __init__(self):
        super().__init__("The server is shutting down and its drain time ran out before this stream finished; "
                         "the request was aborted.")


class NodeLost(APIError):
    """The node generating a request died and the request could not be continued elsewhere."""

    status = 503
    type = "service_unavailable_error"
    code = "node_lost"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def as_api_error(exc: BaseException) -> APIError:
    """Map any exception to the APIError a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidSamplingParams):
        return InvalidRequest(str(exc), param=exc.param)
    if isinstance(exc, ChatTemplateError):
        return InvalidRequest(str(exc), param="messages")
    if isinstance(exc, PromptTooLong):
        return ContextLengthExceeded(str(exc), param="prompt")
    if isinstance(exc, InvalidPrompt):
        return InvalidRequest(str(exc), param="prompt")
    if isinstance(getattr(exc, "error", None), APIError):  # an HTTPException standing for one (guard.BodyOverflow)
        return exc.error
    for cls in type(exc).__mro__:  # errors of the Ray side, known by name so Ray stays unimported here
        if cls.__name__ in _BY_NAME:
            return _BY_NAME[cls.__name__](str(exc))
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError("The server had an error while processing the request.")


#: Cluster-side errors (which may arrive wrapped in a Ray task error) and what a client sees.
_BY_NAME = {
    "NoNodeAvailable": lambda message: ServiceUnavailable(f"No node can serve the request now ({message}); retry shortly."),
    "ResumeImpossible": lambda message: NodeLost(f"The node serving this request was lost and it cannot continue ({message})."),
    "UnknownModel": lambda message: ModelNotServed(message),
}


def _validation_param(loc: tuple) -> str | None:
    """The top-level request field a validation error is about (OpenAI names that one)."""
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None


def validation_message(err: dict) -> str:
    parts = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(parts) or "request body"
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}"
    return f"{where}: {err.get('msg', 'invalid value')}"


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    errors = list(exc.errors())
    if not errors:
        return InvalidRequest("The request is not valid.")
    first = errors[0]
    message = "; ".join(dict.fromkeys(validation_message(e) for e in errors[:5]))
    return InvalidRequest(message, param=_validation_param(tuple(first.get("loc", ()))))


_HTTP_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error"}


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    async def on_known(_: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error")
        body = error_body(str(exc.detail), type_)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(InvalidSamplingParams, on_known)
    app.add_exception_handler(ChatTemplateError, on_known)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


#: Error responses each endpoint declares in /openapi.json.
def declared_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "Invalid parameter (the `param` field names it) or prompt longer than the context",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "The request body is larger than the server accepts",
        429: "Queue full; `Retry-After` says when to retry",
        500: "Unexpected server error",
        503: "No node ready to serve, or the server is shutting down",
        504: "The request ran past the server's time limit and was aborted (`x-should-retry: false`)",
    }
    return {s: {"model": ErrorResponse, "description": descriptions[s]} for s in statuses}
