"""The last minutes of the cluster, sampled, for the dashboard's charts.

Every `period_s` the gateway reads the cluster snapshot once and keeps one point: each
node's generation throughput (from its engine's generated-token counter, so it counts what
the nodes decoded, not the bytes clients received), KV use and prefix hit rate, the
gateway's TTFT p50/p99 over a trailing window and the request errors since the point
before. Rates are derived between two readings here, so the page only draws.

The routing picture is kept beside it: from the coordinator's recent decisions, which node
served which prefix (a prompt's first block) how often, and why the last one went where it
did. A single local engine routes nothing, so it has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("orchard.gateway")

TTFT_WINDOW_S = 15.0  # TTFT quantiles over the requests of the last this many seconds
PREFIXES_KEPT = 40
SEEN_KEPT = 1000  # far more than the coordinator hands back at once, so none is counted twice


@dataclass
class Reading:
    """The cumulative figures at one instant; a point is the difference of two readings."""

    t: float
    generated: dict[str, float]
    hits: dict[str, float]
    queries: dict[str, float]
    failed: int


@dataclass
class PrefixRoutes:
    prefix: str
    served: dict[str, int] = field(default_factory=dict)  # node -> requests routed there
    last_node: str = ""
    last_reason: str = ""
    last_at: float = 0.0
    cached_blocks: int = 0


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile, or None with no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _per_node(nodes: list[dict], key: str) -> dict[str, float]:
    return {str(n["node"]): float(n.get(key) or 0) for n in nodes}


class History:
    """Points sampled every `period_s`, the newest `kept` of them, and the routing picture."""

    def __init__(self, period_s: float = 2.0, kept: int = 300):
        self.period_s = period_s
        self.points: deque[dict[str, Any]] = deque(maxlen=kept)
        self.prefixes: OrderedDict[str, PrefixRoutes] = OrderedDict()
        self._last: Reading | None = None
        self._seen: OrderedDict[tuple[str, float], None] = OrderedDict()  # decisions already counted, newest last

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last.t >= self.period_s * 0.9

    def sample(self, info: dict[str, Any], decisions: list[dict], metrics, now: float | None = None) -> None:
        now = time.time() if now is None else now
        nodes = info.get("nodes") or []
        reading = Reading(now, _per_node(nodes, "generated_tokens"), _per_node(nodes, "prefix_cache_hit_tokens"),
                          _per_node(nodes, "prefix_cache_query_tokens"), metrics.failed_requests)
        if self._last is not None:
            self.points.append(self._point(self._last, reading, nodes, metrics))
        self._last = reading
        self._note_decisions(decisions)

    def _point(self, before: Reading, now: Reading, nodes: list[dict], metrics) -> dict[str, Any]:
        elapsed = max(now.t - before.t, 1e-6)
        throughput, hit_rate = {}, {}
        for node in now.generated:
            made = now.generated[node] - before.generated.get(node, now.generated[node])
            throughput[node] = max(made, 0.0) / elapsed
            asked = now.queries[node] - before.queries.get(node, now.queries[node])
            found = now.hits[node] - before.hits.get(node, now.hits[node])
            hit_rate[node] = found / asked if asked > 0 else None
        kv_use = {str(n["node"]): (n.get("kv_blocks_used") or 0) / n["kv_blocks_total"] if n.get("kv_blocks_total") else 0.0
                  for n in nodes}
        ttfts = [s for at, s in metrics.recent_ttft if at > now.t - TTFT_WINDOW_S]
        return {"t": now.t, "tokens_per_s": throughput, "kv_use": kv_use, "hit_rate": hit_rate,
                "ttft_p50": quantile(ttfts, 0.5), "ttft_p99": quantile(ttfts, 0.99),
                "errors": max(now.failed - before.failed, 0)}

    def _note_decisions(self, decisions: list[dict]) -> None:
        for d in decisions:
            key = (str(d.get("request_id", "")), float(d.get("decided_at") or 0.0))
            prefix = str(d.get("prefix") or "")
            if key in self._seen or not prefix:
                continue
            self._seen[key] = None
            routes = self.prefixes.pop(prefix, None) or PrefixRoutes(prefix)
            node = str(d["node_id"])
            routes.served[node] = routes.served.get(node, 0) + 1
            routes.last_node, routes.last_reason = node, str(d.get("reason", ""))
            routes.last_at, routes.cached_blocks = key[1], int(d.get("cached_blocks") or 0)
            self.prefixes[prefix] = routes  # most recently used last
            while len(self.prefixes) > PREFIXES_KEPT:
                self.prefixes.popitem(last=False)
        while len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)

    def to_dict(self) -> dict[str, Any]:
        prefixes = [vars(r) for r in reversed(self.prefixes.values())]
        return {"period_s": self.period_s, "points": list(self.points), "prefixes": prefixes}


class Sampler:
    """Samples `gateway`'s cluster into `history` when due: every period in the background
    (`run`), and on demand when the page asks and the newest point is older than a period."""

    def __init__(self, gateway, history: History, read_decisions):
        self.gateway, self.history, self.read_decisions = gateway, history, read_decisions
        self._lock = asyncio.Lock()

    async def sample_if_due(self) -> None:
        async with self._lock:
            if not self.history.due(time.time()):
                return
            info = await self.gateway.cluster_snapshot()
            decisions = await self.read_decisions(self.gateway.backend, info)
            self.history.sample(info, decisions, self.gateway.metrics)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # no node yet, a coordinator restarting: try next period
                await self.sample_if_due()
            await asyncio.sleep(self.history.period_s)
