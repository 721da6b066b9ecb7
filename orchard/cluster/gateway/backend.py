"""What the gateway needs from whatever runs the model: a small async protocol.

The gateway speaks HTTP and tokens; a `Backend` turns token ids into a stream of
`RequestOutput`s. `LocalBackend` runs one in-process `AsyncEngine` (tests, `--no-ray`);
the Ray-backed backend routes across nodes. Both report their state through
`cluster_info()` in the same shape, so /v1/cluster and /metrics need not know which one
they talk to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from orchard.node.types import RequestOutput, SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """A model the backend serves; `tokenizer` is mlx-lm's TokenizerWrapper (or alike)."""

    name: str
    max_model_len: int
    tokenizer: Any
    vocab_size: int | None = None  # token ids at or above it are refused; None: take the tokenizer's


@runtime_checkable
class Backend(Protocol):
    async def models(self) -> list[ModelInfo]: ...

    async def ready(self) -> bool: ...

    def generate(
        self, request_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams, session: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; `session` (the client's conversation key) may pick the node."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def cluster_info(self) -> dict[str, Any]: ...

    async def queue_depth(self) -> int: ...

    async def shutdown(self) -> None: ...


def node_entry(node: str, stats: dict[str, Any]) -> dict[str, Any]:
    """One node's figures for /v1/cluster, from an engine's `stats()` (its `kv` part flattened)."""
    kv = stats.get("kv")
    stats = {**kv, **stats} if isinstance(kv, dict) else stats

    def pick(*names: str) -> int:
        for name in names:
            if stats.get(name) is not None:
                return int(stats[name])
        return 0

    hit = pick("prefix_cache_hit_tokens", "prefix_hit_tokens", "cache_hit_tokens")
    query = pick("prefix_cache_query_tokens", "prefix_query_tokens", "cache_query_tokens")
    return {
        "node": node,
        "kv_blocks_used": pick("kv_blocks_used", "num_used_blocks", "blocks_used", "used_blocks"),
        "kv_blocks_cached": pick("kv_blocks_cached", "blocks_cached"),
        "kv_blocks_total": pick("kv_blocks_total", "num_total_blocks", "blocks_total", "num_blocks", "total_blocks"),
        "prefix_cache_hit_tokens": hit,
        "prefix_cache_query_tokens": query,
        "prefix_cache_hit_rate": hit / query if query else 0.0,
        "kv_migrated_blocks": pick("kv_migrated_blocks", "migrated_blocks"),
        "preemptions": pick("preemptions", "num_preemptions", "preemptions_total"),
        "generated_tokens": pick("generated_tokens"),  # the engine's own count, warm-up and aborts included
        "running": pick("running", "num_running"),
        "waiting": pick("waiting", "num_waiting"),
    }


def summarize_nodes(model: str, nodes: list[dict[str, Any]], queue_depth: int) -> dict[str, Any]:
    """The cluster-wide view /v1/cluster serves, summed over `nodes`."""
    hit = sum(n["prefix_cache_hit_tokens"] for n in nodes)
    query = sum(n["prefix_cache_query_tokens"] for n in nodes)
    return {
        "model": model,
        "nodes": nodes,
        "kv_blocks_used": sum(n["kv_blocks_used"] for n in nodes),
        "kv_blocks_total": sum(n["kv_blocks_total"] for n in nodes),
        "prefix_cache_hit_rate": hit / query if query else 0.0,
        "queue_depth": queue_depth,
    }


class LocalBackend:
    """One in-process `AsyncEngine` as a Backend: no Ray, one node named `node_name`.

    Queue depth counts the requests handed to the engine that have not yet produced
    their first output: the ones a new request would wait behind.
    """

    def __init__(self, engine: Any, node_name: str = "local"):
        self.engine = engine
        self.node_name = node_name
        self._awaiting_first_output: set[str] = set()
        self._closed = False

    async def models(self) -> list[ModelInfo]:
        tokenizer = self.engine.tokenizer
        vocab = getattr(self.engine, "vocab_size", None)
        return [ModelInfo(self.engine.model_name, int(self.engine.max_model_len), tokenizer, vocab)]

    async def ready(self) -> bool:
        return not self._closed

    async def generate(
        self, request_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams, session: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """One engine serves every session."""
        self._awaiting_first_output.add(request_id)
        finished = False
        try:
            async for output in self.engine.generate(request_id, prompt_token_ids, params):
                self._awaiting_first_output.discard(request_id)
                finished = output.finished
                yield output
        finally:
            self._awaiting_first_output.discard(request_id)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def cluster_info(self) -> dict[str, Any]:
        nodes = [node_entry(self.node_name, dict(self.engine.stats()))]
        return summarize_nodes(self.engine.model_name, nodes, await self.queue_depth())

    async def queue_depth(self) -> int:
        return len(self._awaiting_first_output)

    async def shutdown(self) -> None:
        self._closed = True
        close = getattr(self.engine, "shutdown", None) or getattr(self.engine, "stop", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result
