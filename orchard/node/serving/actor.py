"""The engine of one machine as a Ray actor: streams tokens out, tells the coordinator what it holds.

The actor is asynchronous: `AsyncEngine` already runs `step()` on its own thread, so the
actor's event loop only moves requests in and outputs out. Two duties beyond serving:

- the engine's KV events go to the coordinator from the actor's event loop, not the engine
  thread, in order (calls from one caller reach the actor in order): the first after a quiet
  spell within `KV_EVENTS_FIRST_S`, then what the steps made meanwhile in one call at most every
  `KV_EVENTS_GAP_S` (each Ray call costs both processes CPU: under 32 streaming clients on
  the 2-core VM the coordinator took 0.05-0.10 of a core answering one call per step);
- every `heartbeat_s`, and soon after a request finishes (so the router does not count a
  finished request as running), the node's load and measured rates go to the coordinator, whose
  reply may ask for a snapshot of the prefix cache or for the node to register again
  (after a coordinator restart), or hand over block moves (hot-prefix copies, drain);
- KV migration (`orchard.node.serving.migration`): a target pulls blocks from a source with
  `pull_blocks`; the payload goes from the source's object store straight to the target.
  On joining, a node probes the link to each peer so migration can be costed at all.

A gateway's requests arrive and their outputs leave on its direct connection
(`orchard.node.serving.gateway_link`, written by the engine thread) when the cluster has a secret,
else through `submit` and the `outputs` Ray stream, which carries what `Subscribers` gathered.

The node never imports `cluster`: the coordinator is found by the name and namespace the
cluster side hands over in `NodeActorConfig`, and spoken to in plain dicts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray

from orchard.kvcache.events import PackedEvents
from orchard.node.async_engine import AsyncEngine
from orchard.node.engine import EngineConfig
from orchard.node.heap import freeze_loaded_objects
from orchard.node.serving.agent import COLD_TIER_DIR_ENV, COLD_TIER_GB_ENV
from orchard.node.serving.direct_path import DirectPath
from orchard.node.serving.gateway_link import GatewayLinkServer, gateway_link_key
from orchard.node.serving.hardware import describe_machine
from orchard.node.serving.kv_link import KVLinkConfig
from orchard.node.serving.link_auth import link_key
from orchard.node.serving.migration import BlockMover, PullResult
from orchard.node.serving.output_streams import Subscribers
from orchard.node.serving.stream_delta import only_new
from orchard.node.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

_SNAPSHOT_ATTEMPTS = 5
#: Early heartbeats (after a request finishes) come at most this often.
_MIN_BEAT_GAP_S = 0.05
#: KV events go to the coordinator at most this often; the router's index lags by at most this.
KV_EVENTS_GAP_S = 0.05
#: The first events after a quiet spell go this long after the engine handed them over, not at once: the
#: engine call that made them settles its caller right after (a pull's closing call), and a send due at once
#: ran before that caller on the loop, so a pull returned a Ray call later (docs/benchmarks.md, "The KV
#: events' send after a pull").
KV_EVENTS_FIRST_S = 0.005



def local_engine_config(engine: EngineConfig, node_id: str, environ=None) -> EngineConfig:
    """`engine` with this machine's cold tier when its join set one: a folder per node under
    it (nodes sharing a machine cannot share one file), as `serve` and `head` give theirs."""
    environ = os.environ if environ is None else environ
    folder = environ.get(COLD_TIER_DIR_ENV)
    if not folder:
        return engine
    size = float(environ.get(COLD_TIER_GB_ENV) or engine.cold_tier_gb)
    return replace(engine, cold_tier_dir=str(Path(folder) / node_id), cold_tier_gb=size)


#: `NodeActorConfig.link.host` for "the address Ray reaches this node at": loopback when the Ray
#: cluster is one machine on loopback, the machine's cluster address when Ray spans machines, so
#: peers on other machines can pull over the direct path. The listener only serves peers that
#: prove the cluster's key (node.serving.link_auth); without a key there is no listener at all.
RAY_NODE_HOST = "ray-node"


@dataclass(frozen=True)
class NodeActorConfig:
    node_id: str
    coordinator_name: str
    namespace: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_name: str | None = None  # served name; the loaded model's own name when None
    heartbeat_s: float = 1.0
    link: KVLinkConfig = field(default_factory=lambda: KVLinkConfig(host=RAY_NODE_HOST))  # the direct KV path's listener
    link_token: str | None = None  # its secret; None: Ray's token from the environment (`orchard.node.serving.link_auth`)


def listen_config(link: KVLinkConfig) -> KVLinkConfig:
    """The link's listener config with `RAY_NODE_HOST` resolved to this process's Ray node address."""
    return replace(link, host=ray.util.get_node_ip_address()) if link.host == RAY_NODE_HOST else link


class NodeActor:
    def __init__(self, config: NodeActorConfig):
        self.config = config
        self.node_id = config.node_id
        self.engine = AsyncEngine.from_config(local_engine_config(config.engine, config.node_id))
        self.model_name = config.model_name or self.engine.model_name
        self._coordinator = None
        self._next_seq = 0  # one past the last KV event handed to the coordinator
        self._queued_prompt_tokens = 0  # prompts accepted here whose prefill has not finished
        self._requests_total = 0
        self._link_prefill: dict[str, int] = {}  # gateway link requests -> prompt tokens not yet prefilled
        self._heartbeat_task: asyncio.Task | None = None
        self._beat_soon = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's event loop, once started
        self._started_at = time.time()
        self.mover = BlockMover(self.engine)
        self.direct = DirectPath(self.mover, config.node_id, link_key(config.link_token), listen_config(config.link))
        self.subscribers = Subscribers()
        self.gateway_link: GatewayLinkServer | None = None  # listening once started, when a key is set
        self._background: set[asyncio.Task] = set()
        self._events_lock = threading.Lock()
        self._pending_events: list = []  # made by the engine thread, not yet sent; a send is scheduled while any wait
        self._events_sent_at = float("-inf")  # the loop's clock at the last send
        self.engine.add_kv_listener(self._push_kv_events)

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> dict:
        """Register with the coordinator and start heartbeating; returns this node's info."""
        self._loop = asyncio.get_running_loop()
        freeze_loaded_objects()
        self.direct.start()  # before registering: the info carries its address
        self._start_gateway_link()
        await self._register()
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
            self._spawn(self._probe_peers())
        return self.info()

    def info(self) -> dict:
        engine = self.engine.engine
        geometry = engine.kv.geometry
        return {
            "model": self.model_name,
            "block_size": geometry.block_size,
            "bytes_per_block": geometry.bytes_per_block,
            "state_bytes": engine.kv.state_geometry.nbytes if engine.kv.states is not None else 0,
            "fingerprint": geometry.model_fingerprint,
            "cache_salt": self.config.engine.cache_salt,
            "max_model_len": self.engine.max_model_len,
            "model_path": str(engine.model.path),
            "vocab_size": engine.model.vocab_size,
            "device": _device_name(),
            "hostname": socket.gethostname(),
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "kv_blocks_total": int(engine.stats()["kv"].get("blocks_total", 0)),
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "kv_link": self.direct.address or "",
            "gateway_link": self.gateway_link.address if self.gateway_link is not None else "",
            "max_num_seqs": engine.config.max_num_seqs,
            **describe_machine(),
        }

    # ---- serving -------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, on_accepted=None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (call with `num_returns="streaming"`), deltas only: the
        receiver rebuilds the rest with `orchard.node.serving.stream_delta.Cumulative`."""
        pending_prefill = len(prompt_token_ids)
        self._queued_prompt_tokens += pending_prefill
        self._requests_total += 1
        try:
            async for output in self.engine.generate(request_id, prompt_token_ids, params, on_accepted):
                self._queued_prompt_tokens -= pending_prefill
                pending_prefill = 0
                yield only_new(output)
        finally:
            self._queued_prompt_tokens -= pending_prefill
            self._beat_soon.set()

    async def submit(self, receiver: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start a request whose outputs go out on `receiver`'s `outputs` stream, coalesced with
        its other requests'; returns once the engine accepted it (raises what refused it)."""
        await self.subscribers.submit(receiver, request_id, lambda accepted: self.generate(request_id, prompt_token_ids, params, accepted))

    def start_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink) -> None:
        """A gateway link's request to the engine, its outputs to the link's sink (node.serving.gateway_link),
        counted in the heartbeat's load as `generate` counts its own (`_link_progress` takes them off)."""
        self._requests_total += 1
        self._queued_prompt_tokens += len(prompt_token_ids)
        self._link_prefill[request_id] = len(prompt_token_ids)
        self.engine.start(request_id, prompt_token_ids, params, sink)

    def _link_progress(self, started: list[str], ended: bool) -> None:
        for request_id in started:
            self._queued_prompt_tokens -= self._link_prefill.pop(request_id, 0)
        if ended:
            self._beat_soon.set()

    async def outputs(self, receiver: str) -> AsyncIterator[list]:
        """`receiver`'s outputs of every request it submitted, a list per message (call with
        `num_returns="streaming"`, one per receiver); closing it aborts them."""
        async for batch in self.subscribers.outputs(receiver):
            yield batch

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> dict:
        counters = self.mover.counters
        return {
            **self.engine.stats(),
            "node_id": self.node_id,
            "model": self.model_name,
            "kv_migrated_blocks": counters.migrated_blocks,
            "kv_migration_failures": counters.migration_failures,
            "kv_link_refused": self.direct.refused,  # connections to this node's listener that failed the handshake
            "kv_link_accepted": self.direct.accepted,  # and those that proved the cluster's key
            "gateway_link_refused": self.gateway_link.refused if self.gateway_link is not None else 0,
        }

    # ---- KV migration --------------------------------------------------------------
    async def export_blocks(self, hashes: list[bytes]) -> bytes:
        """Payload of the leading `hashes` held here; a caller that passes the ref on moves no bytes."""
        return await self.mover.export(hashes)

    async def import_blocks(self, payload_refs: list, source_id: str = "") -> dict:
        """Import payloads given as ObjectRefs (in a list, so Ray hands them over unresolved)."""
        return self._report(await self.mover.import_payloads(payload_refs, source_id))

    async def pull_blocks(self, source, source_id: str, hashes: list[bytes]) -> dict:
        """Fetch the blocks of `hashes` this node lacks from the `source` actor and import them: over
        the direct path (`orchard.node.serving.direct_path`) where one can be made, else through Ray's object store."""
        result = await self.direct.pull(source_id, hashes, lambda peer: self._coord().kv_link.remote(peer))
        if result is None:
            result = await self.mover.pull(lambda chunk: source.export_blocks.remote(chunk), source_id, hashes)
        return self._report(result)

    async def probe_payload(self, nbytes: int) -> bytes:
        return self.mover.make_probe(nbytes)

    async def probe_link(self, source, source_id: str) -> list[tuple[int, float]]:
        """Measure the link from `source` to here with a small and a large probe; tell the coordinator."""
        measured = []
        for nbytes in self.mover.probe_sizes():  # over the path pulls will take: direct, else Ray
            direct = await self.direct.probe(source_id, nbytes, lambda peer: self._coord().kv_link.remote(peer))
            measured.append(direct or await self.mover.probe(source.probe_payload.remote(nbytes)))
            await self._coord().record_transfer.remote(source_id, self.node_id, *measured[-1], "ray" if direct is None else "direct")
        return measured

    def health(self) -> dict:
        return {
            "node_id": self.node_id,
            "ok": self.engine._thread.is_alive(),
            "uptime_s": time.time() - self._started_at,
        }

    def shutdown(self) -> None:
        self.direct.close()
        if self.gateway_link is not None:
            self.gateway_link.close()
        self.engine.shutdown()

    def _start_gateway_link(self) -> None:
        key = gateway_link_key(self.config.link_token)
        if key is not None and self.gateway_link is None:
            host = listen_config(self.config.link).host
            self.gateway_link = GatewayLinkServer(key, self.node_id, self.start_request, self.engine.abort_from_thread,
                                                  self._link_progress, self._loop, host)
            self.gateway_link.start()

    def _report(self, result: PullResult) -> dict:
        report = result.to_dict()
        try:
            self._coord().migration_report.remote(self.node_id, report)
        except Exception as exc:  # the counters are kept here too
            log.warning("node %s: migration report not delivered: %s", self.node_id, exc)
        return report

    async def _probe_peers(self) -> None:
        """Seed link rates both ways with every peer, so the router can ever choose to migrate."""
        me = ray.get_runtime_context().current_actor
        for peer in await self._coord().link_peers.remote(self.node_id):
            try:
                handle = await asyncio.to_thread(ray.get_actor, peer["actor_name"], namespace=self.config.namespace)
                await self.probe_link(handle, peer["node_id"])
                await handle.probe_link.remote(me, self.node_id)
            except Exception as exc:  # a peer that went away meanwhile
                log.info("node %s: link probe with %s failed: %s", self.node_id, peer["node_id"], exc)

    async def _hand_over(self, move: dict) -> None:
        """Ask another node to pull blocks from here (hot-prefix copy or drain)."""
        try:
            target = await asyncio.to_thread(ray.get_actor, move["target_actor"], namespace=self.config.namespace)
            me = ray.get_runtime_context().current_actor
            await target.pull_blocks.remote(me, self.node_id, move["hashes"])
        except Exception as exc:
            log.info("node %s: moving blocks to %s failed: %s", self.node_id, move.get("target"), exc)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- talking to the coordinator ------------------------------------------------
    def _coord(self):
        if self._coordinator is None:
            self._coordinator = ray.get_actor(self.config.coordinator_name, namespace=self.config.namespace)
        return self._coordinator

    def _push_kv_events(self, events) -> None:
        """Engine thread, once per step: queue the step's events for the actor's event loop,
        waking it only when no send is already scheduled, so the engine thread spends no time on
        Ray calls and the loop is not woken every step."""
        if not events:
            return
        self._next_seq = events[-1].seq + 1
        if self._loop is None:  # not started yet: nothing serves on this node, send from here
            self._send_kv_events(list(events))
            return
        with self._events_lock:
            scheduled = bool(self._pending_events)
            self._pending_events.extend(events)
        if not scheduled:
            self._loop.call_soon_threadsafe(self._schedule_kv_events)

    def _schedule_kv_events(self) -> None:
        """Loop: send in `KV_EVENTS_FIRST_S` if the last send is `KV_EVENTS_GAP_S` old, else when it will be."""
        wait = self._events_sent_at + KV_EVENTS_GAP_S - self._loop.time()
        self._loop.call_later(max(KV_EVENTS_FIRST_S, wait), self._flush_kv_events)

    def _flush_kv_events(self) -> None:
        with self._events_lock:
            events, self._pending_events = self._pending_events, []
        self._events_sent_at = self._loop.time()
        self._send_kv_events(events)

    def _send_kv_events(self, events: list) -> None:
        try:
            self._coord().kv_events.remote(self.node_id, PackedEvents.of(events))
        except Exception as exc:  # coordinator away: the gap makes it ask for a snapshot later
            log.warning("node %s: KV events not delivered: %s", self.node_id, exc)
            self._coordinator = None

    async def _register(self) -> None:
        reply = await self._coord().register_node.remote(self.node_id, self._register_info())
        if reply.get("snapshot"):
            await self._send_snapshot()

    def _register_info(self) -> dict:
        return {k: v for k, v in self.info().items() if isinstance(v, (str, int, type(None)))}

    async def _send_snapshot(self) -> None:
        seq, blocks = self._snapshot()
        await self._coord().kv_snapshot.remote(self.node_id, seq, blocks)

    def _snapshot(self) -> tuple[int, list]:
        """Read the prefix cache from the event loop while the engine thread may change it.

        The snapshot's seq is read before its blocks, and applying events is idempotent,
        so anything that changes during the read is corrected by the events that follow.
        """
        for _ in range(_SNAPSHOT_ATTEMPTS):
            try:
                stored = self.engine.engine.kv_snapshot()
                break
            except RuntimeError:  # the cache dict changed size under us; read again
                continue
        else:
            stored = []
        seq = stored[0].seq if stored else self._next_seq
        return seq, [(event.block_hash, event.tier) for event in stored]

    async def _heartbeat_loop(self) -> None:
        while True:
            self._beat_soon.clear()  # the load read next covers every request finished so far
            try:
                reply = await self._coord().heartbeat.remote(self.node_id, self._load())
                if not reply.get("known", True):
                    await self._register()
                elif reply.get("snapshot"):
                    await self._send_snapshot()
                for move in reply.get("moves", ()):
                    self._spawn(self._hand_over(move))
            except Exception as exc:  # the coordinator may be restarting; try again next beat
                log.warning("node %s: heartbeat failed: %s", self.node_id, exc)
                self._coordinator = None
            await self._until_next_beat()

    async def _until_next_beat(self) -> None:
        """Sleep `heartbeat_s`, or less when a request finished meanwhile."""
        await asyncio.sleep(_MIN_BEAT_GAP_S)
        try:
            await asyncio.wait_for(self._beat_soon.wait(), self.config.heartbeat_s - _MIN_BEAT_GAP_S)
        except asyncio.TimeoutError:
            pass

    def _load(self) -> dict:
        return heartbeat_load(self.engine.stats(), max(0, self._queued_prompt_tokens), self._requests_total)


def heartbeat_load(stats: dict, queued_prefill_tokens: int, requests_total: int) -> dict:
    """The load a node sends in its heartbeat (`orchard.cluster.coordinator.membership.NodeLoad`), from its engine's stats."""
    kv = stats.get("kv", {})
    return {
        "waiting": stats.get("waiting", 0),
        "running": stats.get("running", 0),
        "queued_prefill_tokens": queued_prefill_tokens,
        "kv_blocks_used": kv.get("blocks_used", 0),
        "kv_blocks_total": kv.get("blocks_total", 0),
        "prefill_tokens_per_s": _per_second(stats.get("prefill_s_per_token")),
        "prefill_marginal_tokens_per_s": _per_second(stats.get("prefill_marginal_s_per_token")),
        "decode_tokens_per_s": _per_second(stats.get("decode_s_per_token")),
        "prefix_hit_tokens": kv.get("prefix_hit_tokens", 0),
        "prefix_query_tokens": kv.get("prefix_query_tokens", 0),
        "requests_total": requests_total,
    }


def _per_second(seconds_per_token: float | None) -> float | None:
    return 1.0 / seconds_per_token if seconds_per_token else None


def _device_name() -> str:
    try:
        import mlx.core as mx

        return str(mx.default_device())
    except Exception:  # pragma: no cover - a node without MLX cannot serve anyway
        return "unknown"


NodeActorRemote = ray.remote(NodeActor)
