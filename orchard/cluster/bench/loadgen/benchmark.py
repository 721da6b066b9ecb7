"""`bench serve` end to end: resolve the model and how to size prompts, run each concurrency level, build the result.

A sweep repeats the same seeded workload at each concurrency cap, so the levels differ
only in load. The result is a plain JSON-ready dict (see `report.result_document`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
from rich.console import Console

from orchard.cluster.bench.loadgen.client import EndpointConfig, StreamClient
from orchard.cluster.bench.loadgen.config import ServeBenchConfig
from orchard.cluster.bench.loadgen.datasets import conversations
from orchard.cluster.bench.loadgen.progress import RequestProgress
from orchard.cluster.bench.loadgen.report import result_document
from orchard.cluster.bench.loadgen.runner import RunResult, run_load
from orchard.cluster.bench.loadgen.served_tokenizer import choose_prompt_source


def run_bench(cfg: ServeBenchConfig, console: Console | None = None) -> dict:
    """Run the benchmark and return its result document."""
    return asyncio.run(run_bench_async(cfg, console))


async def run_bench_async(cfg: ServeBenchConfig, console: Console | None = None,
                          transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """`transport` replaces the network (tests script a server with httpx.MockTransport)."""
    timeout = httpx.Timeout(cfg.endpoint.timeout_s, connect=30.0)
    # No pool limit: with a burst and no cap, queueing in the pool would hide server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as http:
        endpoint = await resolve_model(http, cfg.endpoint)
        source = await choose_prompt_source(http, endpoint, cfg.tokenizer)
        if console is not None:
            console.print(f"prompt lengths: {source.describe()}")
        client = StreamClient(endpoint, http)
        runs: list[RunResult] = []
        for level in cfg.levels:
            load = replace(cfg.load, max_concurrency=level)
            convs = conversations(cfg.dataset, source, load.request_budget)
            label = f"concurrency {level or 'unbounded'}"
            with RequestProgress(load.num_prompts, label, cfg.progress, console) as bar:
                runs.append(await run_load(convs, client, load, bar.done))
    return result_document(cfg, endpoint, source, runs)


async def resolve_model(http: httpx.AsyncClient, endpoint: EndpointConfig) -> EndpointConfig:
    """Fill in the model from /v1/models when none was given; leave it out if that fails."""
    if endpoint.model:
        return endpoint
    url = endpoint.base_url.rstrip("/") + "/v1/models"
    try:
        resp = await http.get(url, headers=endpoint.headers())
        models = resp.json().get("data") or [] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        models = []
    return replace(endpoint, model=models[0]["id"]) if models else endpoint
