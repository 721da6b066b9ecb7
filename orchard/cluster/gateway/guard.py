"""What the gateway refuses before it reads a request body: oversized bodies and missing keys.

Route handlers receive a parsed body, so any check they make comes after the whole body
was buffered and decoded. A client without a key, or one sending hundreds of megabytes,
must cost the server nothing of the sort: this ASGI layer answers 401 from the headers
alone and 413 from `Content-Length`, or as soon as a body without one grows past the limit.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import Response

from orchard.cluster.gateway.errors import APIError, Unauthorized, error_response

DEFAULT_MAX_BODY_BYTES = 32 << 20
MIN_API_KEY_CHARS = 16  # a short key is one a client can guess through the 401s


class WeakApiKey(ValueError):
    """An API key too short to stand between the network and the model."""


def check_api_keys(keys) -> None:
    """Refuse keys shorter than MIN_API_KEY_CHARS; the message never repeats a key."""
    short = sum(1 for k in keys if len(k) < MIN_API_KEY_CHARS)
    if short:
        raise WeakApiKey(
            f"{short} API key(s) shorter than {MIN_API_KEY_CHARS} characters; use long random keys, "
            "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`."
        )


class BodyTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(f"The request body exceeds the server's limit of {limit} bytes.")


class BodyOverflow(HTTPException):
    """Raised from `receive` when a body without Content-Length passes the limit. An
    HTTPException, because FastAPI turns any other error while reading a body into a 400;
    `error` is the APIError it stands for."""

    def __init__(self, limit: int):
        self.error = BodyTooLarge(limit)
        super().__init__(413, self.error.message)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def bearer_key(scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, key = value.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def presented_key(scope) -> str | None:
    """The API key a request presents: OpenAI clients send a bearer token, Anthropic's `x-api-key`."""
    return bearer_key(scope) or _header(scope, b"x-api-key")


#: Renders a refusal as one API's error response (OpenAI's unless a path prefix names another).
Renderer = Callable[[APIError], Response]


class RequestGuard:
    """ASGI middleware: body-size limit on every request, key check before any body is read.

    A refusal is written in the shape of the API the path belongs to: `renderers` maps path
    prefixes (e.g. "/v1/messages": Anthropic's errors) to their renderer; OpenAI's otherwise.
    """

    def __init__(self, app, max_body_bytes: int, api_keys: frozenset[str], renderers: dict[str, Renderer] | None = None):
        self.app, self.max_body_bytes, self.api_keys = app, max_body_bytes, api_keys
        self.renderers = renderers or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            return await self.render(scope.get("path", ""), refusal)(scope, receive, send)
        return await self.app(scope, self._limited(receive), send)

    def render(self, path: str, error: APIError) -> Response:
        for prefix, renderer in self.renderers.items():
            if path == prefix or path.startswith(prefix + "/"):
                return renderer(error)
        return error_response(error)

    def refusal(self, scope) -> APIError | None:
        """The error a request gets from its headers alone, if any."""
        if self.api_keys and _has_body(scope) and presented_key(scope) not in self.api_keys:
            return Unauthorized()
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            return BodyTooLarge(self.max_body_bytes)
        return None

    def _limited(self, receive):
        seen = 0
        limit = self.max_body_bytes

        async def receive_limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyOverflow(limit)
            return message

        return receive_limited


def _has_body(scope) -> bool:
    """Requests whose route reads a body: every one of them needs a key when keys are set."""
    return scope.get("method", "GET") not in ("GET", "HEAD", "OPTIONS")
