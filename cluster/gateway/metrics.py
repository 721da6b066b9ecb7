"""Prometheus metrics of the gateway, named as DESIGN.md lists them.

Latencies and request counts are measured here as requests pass. Per-node figures (KV
blocks, prefix-cache tokens, migrations, preemptions) belong to the nodes, so they are not
kept twice: each scrape asks the backend for `cluster_info()` and exposes that snapshot
through a collector. Every `GatewayMetrics` owns its registry, so several apps (tests)
never collide in the process-wide default one.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# (metric name without suffix, node_entry key, help, is counter)
_NODE_FIGURES = [
    ("orchard_kv_blocks_used", "kv_blocks_used", "KV blocks in use", False),
    ("orchard_kv_blocks_total", "kv_blocks_total", "KV blocks in the pool", False),
    ("orchard_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "prompt tokens served from cached KV", True),
    ("orchard_prefix_cache_query_tokens", "prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", True),
    ("orchard_kv_migrated_blocks", "kv_migrated_blocks", "KV blocks pulled from another node", True),
    ("orchard_kv_migration_failures", "kv_migration_failures", "KV pulls refused or broken off (recomputed instead)", True),
    ("orchard_preemptions", "preemptions", "sequences preempted for lack of KV blocks", True),
    ("orchard_requests_running", "running", "requests in the running batch", False),
    ("orchard_requests_waiting", "waiting", "requests waiting for admission", False),
]


class NodeSnapshotCollector(Collector):
    """Exposes the latest `cluster_info()` snapshot, one sample per node."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"nodes": [], "queue_depth": 0}

    def collect(self):
        nodes = self.snapshot.get("nodes", [])
        for name, key, doc, is_counter in _NODE_FIGURES:
            family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = family_type(name, doc, labels=["node"])
            for node in nodes:
                family.add_metric([str(node.get("node", "?"))], float(node.get(key, 0) or 0))
            yield family
        queue = GaugeMetricFamily("orchard_queue_depth", "requests accepted by the gateway and not yet started")
        queue.add_metric([], float(self.snapshot.get("queue_depth", 0)))
        yield queue


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "orchard_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "orchard_time_to_first_token_seconds", "time from request arrival to its first token",
            ["node"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token = Histogram(
            "orchard_inter_token_latency_seconds", "time between consecutive tokens of one sequence",
            ["node"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "orchard_generated_tokens", "completion tokens sent to clients", registry=self.registry
        )
        self.nodes = NodeSnapshotCollector()
        self.registry.register(self.nodes)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self, cluster_info: dict[str, Any]) -> bytes:
        self.nodes.snapshot = cluster_info
        return generate_latest(self.registry)
