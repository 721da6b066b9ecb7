"""The session key of a request: which conversation it continues, so the router can keep it on one node.

A client names its conversation with the `X-Session-Id` header, or in the body: OpenAI's
`prompt_cache_key` (meant for exactly this: requests sharing it are routed to share a cache),
then `user`; Anthropic's `metadata.user_id` arrives as `user` (orchard/cluster/gateway/messages_api.py).
The header wins over the body. A request naming none is routed by its prefix alone.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from orchard.cluster.gateway.errors import InvalidRequest

SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256  # a key is held in the router's memory for a while; a longer one is refused


def session_key(request: Request, body: Any) -> str | None:
    """The request's session key, or None when it names none; an over-long key is a 400."""
    header = request.headers.get(SESSION_HEADER)
    for key, field in ((header, SESSION_HEADER), (getattr(body, "prompt_cache_key", None), "prompt_cache_key"),
                       (getattr(body, "user", None), "user")):
        if key:
            if len(key) > MAX_SESSION_CHARS:
                raise InvalidRequest(f"{field} may be at most {MAX_SESSION_CHARS} characters", param=field)
            return key
    return None
