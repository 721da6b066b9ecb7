"""The live cluster page: GET /dashboard, its two static files, and the JSON it polls.

The page itself holds no data, so it is public; it reads /v1/cluster and
/v1/cluster/activity with the API key the user types into it (or passes once as
`/dashboard?key=...`), kept in the tab's sessionStorage. Activity is what /v1/cluster
does not say: the coordinator's recent routing decisions with their reason, and the
gateway's running totals, from which the page derives throughput between two polls.
Static files are read from the package (`cluster/gateway/static/`), so serving needs no build step.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict

DECISIONS_SHOWN = 20
COMPLETION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

#: Files the page loads besides itself, with their media types. Fixed names: no path is
#: ever taken from the request.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


class MigrationInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    source: str
    num_blocks: int


class RoutingDecision(BaseModel):
    """One routing decision as the coordinator's router recorded it."""

    model_config = ConfigDict(extra="allow")

    node_id: str
    reason: str  # prefix-hit | migrate | load | only-node | round-robin | least-loaded | random
    cached_blocks: int = 0
    policy: str = ""
    num_candidates: int = 0
    request_id: str = ""
    decided_at: float = 0.0  # seconds since the epoch
    migration: MigrationInfo | None = None


class ClusterActivity(BaseModel):
    """Recent routing decisions (newest last) and the gateway's totals since it started."""

    decisions: list[RoutingDecision]
    generated_tokens: int
    completed_requests: int
    time: float  # the gateway's clock, seconds since the epoch, when these figures were read


def static_text(name: str) -> str:
    return resources.files("cluster.gateway").joinpath("static", name).read_text(encoding="utf-8")


async def recent_decisions(backend: Any, info: dict[str, Any], limit: int = DECISIONS_SHOWN) -> list[dict]:
    """A backend's own `recent_decisions(limit)` when it has one; else what its cluster view
    carries (the coordinator's, under `coordinator.recent_decisions`); a single local engine
    routes nothing, so it has none."""
    own = getattr(backend, "recent_decisions", None)
    if callable(own):
        return list(await own(limit))[-limit:]
    coordinator = info.get("coordinator") or {}
    return list(coordinator.get("recent_decisions") or [])[-limit:]


def gateway_totals(registry) -> tuple[int, int]:
    """Completion tokens sent and completion requests answered with 200, from the metrics."""
    tokens = registry.get_sample_value("orchard_generated_tokens_total") or 0.0
    completed = sum(
        registry.get_sample_value("orchard_requests_total", {"endpoint": endpoint, "status": "200"}) or 0.0
        for endpoint in COMPLETION_ENDPOINTS
    )
    return int(tokens), int(completed)


#: The page loads only its own script and stylesheet and talks only to this server; it may
#: not be framed (clickjacking), and its URL, which can hold `?key=`, is never sent as a Referer.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def install_dashboard(app: FastAPI, gateway, auth: list, errors: dict) -> None:
    """Add /dashboard (public), its assets, and /v1/cluster/activity (behind `auth`)."""

    @app.get("/dashboard", response_class=HTMLResponse,
             responses={200: {"description": "the live cluster page (it reads its data with the API key)"}})
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(static_text("dashboard.html"), headers=PAGE_HEADERS)

    for name, media_type in ASSETS.items():
        app.add_api_route(f"/dashboard/{name}", _asset(name, media_type), methods=["GET"], include_in_schema=False)

    @app.get("/v1/cluster/activity", response_model=ClusterActivity, dependencies=auth, responses=errors)
    async def cluster_activity() -> ClusterActivity:
        info = await gateway.cluster_snapshot()
        decisions = await recent_decisions(gateway.backend, info)
        tokens, completed = gateway_totals(gateway.metrics.registry)
        return ClusterActivity(decisions=decisions, generated_tokens=tokens, completed_requests=completed,
                               time=time.time())


def _asset(name: str, media_type: str):
    async def serve_asset() -> Response:
        return Response(static_text(name), media_type=media_type, headers=PAGE_HEADERS)

    return serve_asset
