"""The models a Ray-backed gateway serves, kept as local state (cluster.gateway.ray_backend).

A request needs its model's spec (block size, hash root, tokenizer) before it can be routed.
Asking the coordinator for it every time would put a second Ray round trip ahead of the one a
request must make, `route`. So the list is fetched once and then refreshed in the background
whenever a request finds it older than `refresh_s`: a request reads the list it has and never
waits for the coordinator's answer; a model the list does not hold yet (its node just joined)
is waited for, patiently, by `spec`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray.exceptions as rex

from orchard.kvcache.hashing import root_hash

log = logging.getLogger(__name__)

#: Between patient asks of the coordinator (a model no node serves yet, a coordinator restarting).
RETRY_S = 0.25


class UnknownModel(LookupError):
    """No live node serves the requested model."""


@dataclass
class ModelSpec:
    name: str
    block_size: int
    root: bytes
    max_model_len: int
    vocab_size: int | None
    model_path: str
    tokenizer: Any = None


#: (patient) -> the coordinator's `model_specs`; patient rides out a coordinator restart
SpecsFetcher = Callable[[bool], Awaitable[dict[str, dict]]]


class ServedModels:
    """Every model seen (kept for its tokenizer) and the ones a live node served at the last refresh."""

    def __init__(self, fetch: SpecsFetcher, refresh_s: float, wait_s: float):
        self.fetch, self.refresh_s, self.wait_s = fetch, refresh_s, wait_s
        self.specs: dict[str, ModelSpec] = {}
        self.served: set[str] = set()
        self.fetched_at = float("-inf")  # time.monotonic() of the last answer
        self.reachable = True  # whether the last background refresh reached the coordinator
        self._refreshing: asyncio.Task | None = None

    async def fresh(self) -> None:
        """Fetch the list if there is none yet; start a background refresh if it is stale."""
        if self.fetched_at == float("-inf"):
            await self.refresh(patient=False)
        elif time.monotonic() - self.fetched_at >= self.refresh_s and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_in_background())

    def ready(self) -> bool:
        return self.reachable and bool(self.served)

    def listed(self) -> list[ModelSpec]:
        return [s for s in self.specs.values() if s.name in self.served]

    async def refresh(self, patient: bool = True) -> None:
        served = await self.fetch(patient)
        self.served, self.fetched_at, self.reachable = set(served), time.monotonic(), True
        for name, info in served.items():
            if name not in self.specs:
                self.specs[name] = ModelSpec(
                    name=name, block_size=info["block_size"], root=root_hash(info["fingerprint"], info.get("cache_salt")),
                    max_model_len=info["max_model_len"], vocab_size=info.get("vocab_size") or None,
                    model_path=info["model_path"],
                )

    async def spec(self, model: str) -> ModelSpec:
        """`model`'s spec with its tokenizer loaded, waiting up to `wait_s` for a node to serve it."""
        deadline = time.monotonic() + self.wait_s
        while model not in self.specs:
            await self.refresh()
            if model in self.specs:
                break
            if time.monotonic() >= deadline:
                raise UnknownModel(f"no node serves model {model!r}")
            await asyncio.sleep(RETRY_S)
        spec = self.specs[model]
        await self.tokenizer(spec)
        return spec

    async def tokenizer(self, spec: ModelSpec):
        if spec.tokenizer is None:
            from mlx_lm.utils import load_tokenizer

            spec.tokenizer = await asyncio.to_thread(load_tokenizer, spec.model_path)
        return spec.tokenizer

    async def _refresh_in_background(self) -> None:
        try:
            await self.refresh(patient=False)
        except rex.RayError as exc:
            self.reachable = False
            log.warning("could not refresh the served models: %s", exc)
