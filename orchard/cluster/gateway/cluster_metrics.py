"""The nodes' own figures as Prometheus families, from one `cluster_info()` snapshot per scrape.

Each figure is exposed twice where vLLM has a name for it: as `orchard_*{node}` (the names
DESIGN.md lists) and as `vllm:*{model_name, node}`. Counters never go down between two
scrapes: a node that does not answer in time is reported from its heartbeat, which may
lack a counter, so the collector keeps the highest value seen per node.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# (metric name without suffix, node entry key, help, is counter)
ORCHARD_NODE_FIGURES = [
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

VLLM_NODE_FIGURES = [
    ("vllm:num_requests_running", "running", "requests in the node's running batch", False),
    ("vllm:num_requests_waiting", "waiting", "requests waiting in the node's queue", False),
    ("vllm:prefix_cache_queries", "prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", True),
    ("vllm:prefix_cache_hits", "prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", True),
    ("vllm:num_preemptions", "preemptions", "sequences preempted for lack of KV blocks", True),
    ("vllm:generation_tokens", "generated_tokens", "tokens the node's engine generated", True),
]

#: Both spellings vLLM has used for the fraction (0 to 1) of KV blocks in use.
VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def model_of(snapshot: dict[str, Any], node: dict[str, Any]) -> str:
    """The cluster's model name (the first --served-model-name) when it serves one; else the node's."""
    model = str(snapshot.get("model") or "")
    return str(node.get("model") or model) if ", " in model or not model else model


class NodeSnapshotCollector(Collector):
    """Exposes the latest `cluster_info()` snapshot, one sample per node."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"nodes": [], "queue_depth": 0}
        self._highest: dict[tuple[str, str], float] = {}  # (family, node) -> counter value

    def collect(self):
        nodes = self.snapshot.get("nodes", [])
        yield from self._orchard_families(nodes)
        yield from self._vllm_families(nodes)
        yield self._routing_family()

    def _value(self, name: str, node: dict, key: str, is_counter: bool) -> float:
        value = float(node.get(key, 0) or 0)
        if is_counter:
            slot = (name, str(node.get("node", "?")))
            value = self._highest[slot] = max(value, self._highest.get(slot, 0.0))
        return value

    def _orchard_families(self, nodes: list[dict]):
        for name, key, doc, is_counter in ORCHARD_NODE_FIGURES:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=["node"])
            for node in nodes:
                family.add_metric([str(node.get("node", "?"))], self._value(name, node, key, is_counter))
            yield family
        queue = GaugeMetricFamily("orchard_queue_depth", "requests accepted by the gateway and not yet started")
        queue.add_metric([], float(self.snapshot.get("queue_depth", 0)))
        yield queue

    def _vllm_families(self, nodes: list[dict]):
        labels = ["model_name", "node"]
        for name, key, doc, is_counter in VLLM_NODE_FIGURES:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=labels)
            for node in nodes:
                family.add_metric([model_of(self.snapshot, node), str(node.get("node", "?"))],
                                  self._value(name, node, key, is_counter))
            yield family
        for name in VLLM_KV_USAGE:
            family = GaugeMetricFamily(name, "fraction of the node's KV blocks in use (1 is full)", labels=labels)
            for node in nodes:
                total = node.get("kv_blocks_total") or 0
                used = node.get("kv_blocks_used") or 0
                family.add_metric([model_of(self.snapshot, node), str(node.get("node", "?"))], used / total if total else 0.0)
            yield family

    def _routing_family(self):
        """The coordinator's routing decisions by node and reason (none for a single local engine)."""
        family = CounterMetricFamily("orchard_routing_decisions", "requests routed, by chosen node and reason",
                                     labels=["node", "reason"])
        routing = (self.snapshot.get("coordinator") or {}).get("routing") or {}
        for row in routing.get("decisions") or []:
            family.add_metric([str(row["node"]), str(row["reason"])], float(row["count"]))
        return family
