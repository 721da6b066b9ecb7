"""Prometheus metrics of the gateway: the `orchard_*` families DESIGN.md lists, and beside
them the `vllm:*` families that mean the same thing here, so vLLM's Grafana dashboard and
alerts work unchanged (docs/metrics.md has the table).

Request figures (latencies, token counts, finish reasons) are measured here as requests
pass, labelled by the model name the request used and the node that served it. Per-node
figures (KV blocks, prefix-cache tokens, generated tokens, migrations, preemptions) belong
to the nodes, so they are not kept twice: each scrape asks the backend for `cluster_info()`
and `cluster_metrics.NodeSnapshotCollector` exposes that snapshot. Every `GatewayMetrics`
owns its registry, so several apps (tests) never collide in the process-wide default one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from orchard.cluster.gateway.cluster_metrics import NodeSnapshotCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LONG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000

#: Endpoints whose 4xx and 5xx answers count as request errors on the dashboard.
GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
RECENT_TTFT_KEPT = 4096

_REQUEST = ["model_name", "node"]


@dataclass
class JobTimes:
    """When one engine job arrived, was handed to the backend, and produced tokens (perf_counter s)."""

    arrived: float
    handed: float
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    node: str | None = None  # the node that answered, once one has
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("orchard_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("orchard_time_to_first_token_seconds", "time from request arrival to its first token",
                              ["node"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("orchard_inter_token_latency_seconds",
                                     "time between consecutive tokens of one sequence",
                                     ["node"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("orchard_generated_tokens", "completion tokens sent to clients", registry=r)
        self.vllm = VllmRequestFamilies(r)
        self.nodes = NodeSnapshotCollector()
        r.register(self.nodes)
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=RECENT_TTFT_KEPT)  # (epoch s, TTFT s)
        self.failed_requests = 0  # GENERATION_ENDPOINTS answers with status >= 400

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if status >= 400 and endpoint in GENERATION_ENDPOINTS:
            self.failed_requests += 1

    def first_tokens(self, job: JobTimes, model: str, node: str) -> None:
        ttft = job.first - job.arrived
        self.ttft.labels(node=node).observe(ttft)
        self.recent_ttft.append((time.time(), ttft))
        self.vllm.started(job, model, node)

    def next_tokens(self, job: JobTimes, now: float, model: str, node: str) -> None:
        self.inter_token.labels(node=node).observe(now - job.last)
        self.vllm.itl.labels(model, node).observe(now - job.last)

    def finished(self, job: JobTimes, model: str, node: str, reasons: list[str], max_tokens: int | None) -> None:
        self.vllm.finished(job, model, node, reasons, max_tokens)

    def render(self, cluster_info: dict[str, Any]) -> bytes:
        self.nodes.snapshot = cluster_info
        return generate_latest(self.registry)


class VllmRequestFamilies:
    """vLLM's per-request families, measured at the gateway. The node does not report when
    it scheduled a request, so queue time is the gateway's (arrival until the backend took
    the job) and time spent waiting inside an engine counts as prefill."""

    def __init__(self, r: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, _REQUEST, buckets=buckets, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "arrival to first token")
        self.itl = hist("vllm:inter_token_latency_seconds", "time between two outputs of one sequence")
        self.tpot = hist("vllm:time_per_output_token_seconds", "a request's mean time per output token after the first")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "arrival to last token", _LONG_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "arrival until the backend took the job", _LONG_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "backend took the job to first token", _LONG_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "first token to last token", _LONG_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "backend took the job to last token", _LONG_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "prompt tokens per request", _TOKEN_BUCKETS)
        self.generation_len = hist("vllm:request_generation_tokens", "tokens generated per choice", _TOKEN_BUCKETS)
        self.max_generation = hist("vllm:request_max_num_generation_tokens", "the most tokens one choice of a request made",
                                   _TOKEN_BUCKETS)
        self.max_tokens = hist("vllm:request_params_max_tokens", "the max_tokens a request asked for", _TOKEN_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of requests that started", _REQUEST, registry=r)
        self.success = Counter("vllm:request_success", "finished choices, by finish reason",
                               [*_REQUEST, "finished_reason"], registry=r)

    def started(self, job: JobTimes, model: str, node: str) -> None:
        self.ttft.labels(model, node).observe(job.first - job.arrived)
        self.queue.labels(model, node).observe(job.handed - job.arrived)
        self.prefill.labels(model, node).observe(job.first - job.handed)
        self.prompt_len.labels(model, node).observe(job.prompt_tokens)
        self.prompt_tokens.labels(model, node).inc(job.prompt_tokens)

    def finished(self, job: JobTimes, model: str, node: str, reasons: list[str], max_tokens: int | None) -> None:
        end = job.last if job.last is not None else time.perf_counter()
        generated = max(job.tokens.values(), default=0)
        self.e2e.labels(model, node).observe(end - job.arrived)
        self.inference.labels(model, node).observe(end - job.handed)
        if job.first is not None:
            self.decode.labels(model, node).observe(end - job.first)
            if generated > 1:
                self.tpot.labels(model, node).observe((end - job.first) / (generated - 1))
        for index, reason in enumerate(reasons):
            self.success.labels(model, node, reason).inc()
            self.generation_len.labels(model, node).observe(job.tokens.get(index, 0))
        self.max_generation.labels(model, node).observe(generated)
        if max_tokens is not None:
            self.max_tokens.labels(model, node).observe(max_tokens)
