"""A serving node in a network namespace of the rig (`orchard.cluster.bench.netns`), driven over a pipe.

Each node is a spawned process (its own GIL, as a node actor has) that moves itself into
its host's namespace before it opens a socket, loads a demo model into an engine and
listens on the direct KV path (`orchard.node.serving.direct_path`) at its host's private address
only. No Ray: the driver asks it to seed a prefix, pull one from a peer, time a first
token or report the load a node actor would send in its heartbeat, and plays the
coordinator itself with the plain `orchard.cluster.coordinator.coordinator.Coordinator`.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

LINK_SECRET = "a-cluster-token-of-at-least-32-characters-for-the-netns-rig"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class NodeSpec:
    name: str  # the node id, as the coordinator and the link's handshake know it
    namespace: str
    host: str  # the private address its KV listener binds
    size: str  # demo model size: "small" or "large"
    num_blocks: int
    compress: str = "auto"  # its pulls' `KVLinkConfig.compress`


class NodeProcess:
    """The driver's handle on one node process: each method is one request over the pipe."""

    def __init__(self, spec: NodeSpec):
        ctx = mp.get_context("spawn")
        self.spec = spec
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_node_main, args=(theirs, spec), daemon=True)
        self.process.start()
        self.info = self._ask("info")

    def seed(self, tokens: list[int], seed: int) -> list[bytes]:
        """Place the full blocks of `tokens` in this node's pool by importing made-up KV under their
        true hashes (a pull moves bytes whatever they mean; no prefill); returns the hashes."""
        return self._ask("seed", tokens, seed)

    def pull(self, source: NodeProcess, hashes: list[bytes]) -> dict:
        """Pull `hashes` from `source` over the direct path: the pull's report and the call's wall seconds."""
        return self._ask("pull", source.spec.name, source.info["address"], hashes)

    def first_token_s(self, tokens: list[int]) -> float:
        """Seconds from submitting `tokens` to their first output token."""
        return self._ask("ttft", tokens)

    def migrated_ttft(self, source: NodeProcess, hashes: list[bytes], tokens: list[int]) -> dict:
        """Pull the prefix, then time the prompt's first token: the pull's report and the total seconds."""
        return self._ask("migrate", source.spec.name, source.info["address"], hashes, tokens)

    def load(self) -> dict:
        """What a node actor would send in its heartbeat (`orchard.node.serving.actor.heartbeat_load`)."""
        return self._ask("load")

    def close(self) -> None:
        try:
            self._conn.send(("stop", ()))
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _ask(self, command: str, *args):
        self._conn.send((command, args))
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"node {self.spec.name}: {command} failed: {value}")
        return value


# ---- the node process -------------------------------------------------------------


class _Node:
    def __init__(self, spec: NodeSpec):
        from orchard.node.async_engine import AsyncEngine
        from orchard.node.engine import EngineConfig, LLMEngine
        from orchard.node.heap import freeze_loaded_objects
        from orchard.node.model.demo import default_demo_model_path
        from orchard.node.serving import link_auth
        from orchard.node.serving.direct_path import DirectPath
        from orchard.node.serving.kv_link import KVLinkConfig
        from orchard.node.serving.migration import BlockMover

        self.spec = spec
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = EngineConfig(model=str(default_demo_model_path(spec.size)), block_size=BLOCK_SIZE,
                              num_blocks=spec.num_blocks, max_num_seqs=4, max_num_batched_tokens=512)
        self.engine = AsyncEngine(LLMEngine(config))
        freeze_loaded_objects()  # as a node actor does when it starts
        key = link_auth.link_key(LINK_SECRET)
        self.path = DirectPath(BlockMover(self.engine), spec.name, key, KVLinkConfig(host=spec.host, compress=spec.compress))
        self.path.start()
        self.requests = 0

    def info(self) -> dict:
        kv = self.engine.engine.kv
        return {"address": self.path.address, "block_size": kv.geometry.block_size,
                "bytes_per_block": kv.geometry.bytes_per_block, "fingerprint": kv.geometry.model_fingerprint,
                "kv_blocks_total": int(self.engine.stats()["kv"].get("blocks_total", 0)), "max_num_seqs": 4}

    def seed(self, tokens: list[int], seed: int) -> list[bytes]:
        return self._wait(self.engine.run_on_engine(lambda e: seed_kv(e.kv, tokens, seed)))

    def pull(self, source: str, address: str, hashes: list[bytes]) -> dict:
        started = time.perf_counter()
        result = self._wait(self.path.pull(source, hashes, _resolver(address)))
        if result is None or not result.ok or result.imported + result.local != len(hashes):
            raise RuntimeError(f"pull fell short: {result}")
        return {"bytes": result.bytes, "seconds": result.seconds, "wall_s": time.perf_counter() - started,
                "imported": result.imported}

    def ttft(self, tokens: list[int]) -> float:
        from orchard.node.types import SamplingParams

        self.requests += 1
        return self._wait(_first_token_s(self.engine, f"r{self.requests}", tokens,
                                         SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))

    def migrate(self, source: str, address: str, hashes: list[bytes], tokens: list[int]) -> dict:
        started = time.perf_counter()
        report = self.pull(source, address, hashes)
        first = self.ttft(tokens)
        return {**report, "ttft_s": time.perf_counter() - started, "first_token_s": first}

    def load(self) -> dict:
        from orchard.node.serving.actor import heartbeat_load

        return heartbeat_load(self.engine.stats(), 0, self.requests)

    def close(self) -> None:
        self.path.close()
        self.engine.shutdown()

    def _wait(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _node_main(conn, spec: NodeSpec) -> None:
    """The child: into the namespace first (before any socket), then serve requests until "stop"."""
    from orchard.cluster.bench.netns import enter

    enter(spec.namespace)
    node = _Node(spec)
    handlers = {"info": node.info, "seed": node.seed, "pull": node.pull, "ttft": node.ttft, "migrate": node.migrate,
                "load": node.load}
    while True:
        command, args = conn.recv()
        if command == "stop":
            break
        try:
            conn.send((True, handlers[command](*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            conn.send((False, f"{type(exc).__name__}: {exc}"))
    node.close()


def _resolver(address: str):
    async def resolve(_peer: str) -> str:
        return address

    return resolve


async def _first_token_s(engine, request_id: str, tokens: list[int], params) -> float:
    started = time.perf_counter()
    first = None
    async for _ in engine.generate(request_id, tokens, params):
        first = first or time.perf_counter() - started
    return first


def seed_kv(kv, tokens: list[int], seed: int) -> list[bytes]:
    """Import made-up KV for the full blocks of `tokens` under their true hashes (engine thread)."""
    import numpy as np

    from orchard.kvcache.wire import KVBlockData, encode_blocks

    geometry, bs = kv.geometry, kv.geometry.block_size
    hashes = kv.block_hashes(tokens[: len(tokens) // bs * bs])
    parents = [kv.root, *hashes[:-1]]
    rng = np.random.default_rng(seed)
    for start in range(0, len(hashes), 64):
        stop = min(start + 64, len(hashes))
        keys, values = random_kv(geometry, stop - start, rng), random_kv(geometry, stop - start, rng)
        blocks = [KVBlockData(hashes[i], parents[i], tuple(tokens[i * bs : (i + 1) * bs]), keys[i - start], values[i - start])
                  for i in range(start, stop)]
        kv.import_blocks(encode_blocks(geometry, blocks))
    return [bytes(h) for h in hashes]


def random_kv(geometry, n: int, rng):
    """`n` blocks of K (or V) for every layer, each element drawn on its own from a standard normal and
    stored in the geometry's dtype: no two blocks alike, as no two blocks of a real prefix are (a
    compressed pull would otherwise find the repeats)."""
    import numpy as np

    drawn = rng.standard_normal((n, geometry.num_layers, *geometry.block_shape), dtype=np.float32)
    if geometry.dtype != "bfloat16":
        return drawn.astype(geometry.numpy_storage_dtype)
    import mlx.core as mx

    return np.array(mx.array(drawn).astype(mx.bfloat16).view(mx.uint16))
