"""The gateway's `Backend` over a Ray cluster: route with the coordinator, stream from a node.

For each request the backend hashes the prompt's blocks exactly as the nodes do (same
root: the model fingerprint and cache salt the nodes registered), asks the coordinator for
a node, and streams `RequestOutput`s from that node's actor. If the node dies mid-stream
(the actor crashes, its raylet is killed, or it stops heartbeating while the stream is
silent), the request is routed again without that node and resumed from its prompt plus
the tokens already streamed, which the sampler counts as output (penalties, seeded noise
positions); outputs are rewritten so the client sees one stream of one request. Greedy and
seeded output, with or without penalties, are therefore the same as without the fault
(unseeded requests get a seed here for that). A request with n > 1 that loses its node
after streaming ends with an error instead (`ResumeImpossible`).

When the route carries a migration plan, the target node first pulls those blocks from
the source node (`orchard.cluster.gateway.block_pull`); any failure there only means the target recomputes.

The served models and their specs are local state (`orchard.cluster.gateway.served_models`), refreshed
behind requests: `route` is the one coordinator call a request waits for.

Everything here is awaited: no `ray.get` runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import ray
import ray.exceptions as rex

from orchard.cluster.coordinator.coordinator import COORDINATOR_NAME, NAMESPACE
from orchard.cluster.coordinator.route_link import RouteLinks, route_link_key
from orchard.cluster.coordinator.router import NoNodeAvailable, RouteDecision
from orchard.cluster.gateway.backend import ModelInfo, node_entry, summarize_nodes
from orchard.cluster.gateway.block_pull import MigrationOutcome, MigrationPolicy, migration_hashes, pull_for_request
from orchard.cluster.gateway.node_streams import NodeLost, NodeStreams, next_item
from orchard.cluster.gateway.resume import Progress, resume_params, seeded
from orchard.cluster.gateway.served_models import RETRY_S, ServedModels
from orchard.cluster.runtime.ray_cluster import node_actor_name
from orchard.kvcache.hashing import block_hashes
from orchard.node.async_engine import EngineStepFailed
from orchard.node.serving.gateway_link import gateway_link_key
from orchard.node.serving.output_streams import StreamFailed
from orchard.node.serving.stream_delta import Cumulative
from orchard.node.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a scrape waits for a node's fresh counters before using its last heartbeat's.
NODE_STATS_TIMEOUT_S = 1.0

#: Errors that mean "the node is gone", as opposed to the request being refused.
NODE_LOST_ERRORS = (
    rex.RayActorError,
    rex.ObjectLostError,
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
)


async def ride_out(call: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """`call()`, made again every `RETRY_S` while the coordinator restarts (RayActorError) or has no node
    for the model yet (NoNodeAvailable: the moments before nodes re-register), for up to `wait_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await call()
        except (rex.RayActorError, NoNodeAvailable):
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(RETRY_S)


class ResumeImpossible(RuntimeError):
    """A stream lost its node and cannot be resumed elsewhere (retries spent, or n > 1 mid-stream)."""


@dataclass(frozen=True)
class RayBackendConfig:
    address: str | None = None  # used only when this process is not connected yet; None means "auto"
    namespace: str = NAMESPACE
    coordinator_name: str = COORDINATOR_NAME
    policy: str | None = None  # None: the coordinator's configured policy
    max_resumes: int = 3
    stall_check_s: float = 1.0  # while a stream is silent, ask this often whether its node still lives
    # How long to ride out a coordinator restart (or nodes not registered yet) before failing.
    coordinator_wait_s: float = 10.0
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)
    # How stale the gateway's list of served models may be (a new model shows up within this).
    specs_refresh_s: float = 1.0
    # The cluster's secret for the direct links (the nodes' gateway links, the coordinator's route link); None:
    # the Ray token in the environment (as nodes and coordinator take it). Without either, Ray carries it all.
    link_token: str | None = None


class RayBackend:
    def __init__(self, config: RayBackendConfig | None = None):
        self.config = config or RayBackendConfig()
        if not ray.is_initialized():
            ray.init(address=self.config.address or "auto", namespace=self.config.namespace, log_to_driver=False)
        self._coordinator = ray.get_actor(self.config.coordinator_name, namespace=self.config.namespace)
        self._models = ServedModels(self._fetch_specs, self.config.specs_refresh_s, self.config.coordinator_wait_s)
        self._actors: dict[str, Any] = {}
        self._active: dict[str, tuple[str, str]] = {}  # request id -> (node id, id on that node)
        self._awaiting_first_output: set[str] = set()
        self._streams = NodeStreams(gateway_link_key(self.config.link_token))  # one coalesced output stream per node
        self._route_links = RouteLinks(route_link_key(self.config.link_token), self._coordinator.route_link.remote)
        self._closed = False
        self.resumed_mid_stream = 0  # requests that lost a node after streaming some tokens
        self.last_migration: MigrationOutcome | None = None

    # ---- Backend protocol ----------------------------------------------------------
    async def models(self) -> list[ModelInfo]:
        await self._models.fresh()
        return [ModelInfo(s.name, s.max_model_len, await self._models.tokenizer(s), s.vocab_size)
                for s in self._models.listed()]

    async def ready(self) -> bool:
        if self._closed:
            return False
        try:
            await self._models.fresh()
        except rex.RayError:
            return False
        return self._models.ready()

    async def generate(
        self, request_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams, session: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        spec = await self._models.spec(model)
        params = seeded(params)
        hashes = block_hashes(prompt_token_ids, spec.block_size, spec.root)
        progress = Progress()
        lost: list[str] = []
        self._awaiting_first_output.add(request_id)
        try:
            while True:
                attempt_prompt = list(prompt_token_ids) + progress.token_ids
                attempt_hashes = hashes if not progress.token_ids else block_hashes(attempt_prompt, spec.block_size, spec.root)
                decision = await self._route(
                    model, attempt_hashes, len(attempt_prompt), spec.block_size, request_id, self.config.policy, lost,
                    session or "",
                )
                node_id = decision.node_id
                if decision.migration is not None:
                    await self._migrate(decision, attempt_hashes)
                try:  # closed here, not when collected: a client that leaves is aborted on its node at once
                    async with contextlib.aclosing(self._attempt(node_id, request_id, len(lost), attempt_prompt, params,
                                                                 progress)) as outputs:
                        async for out in outputs:
                            self._awaiting_first_output.discard(request_id)
                            yield self._rebase(out, request_id, prompt_token_ids, progress, spec)
                            if out.finished:
                                return
                    return
                except NodeLost as exc:
                    await self._lose(node_id, str(exc))
                    lost.append(node_id)
                    self._check_resumable(request_id, params, progress, lost)
                    progress.resume(spec.tokenizer)
                    self.resumed_mid_stream += bool(progress.token_ids)
                    log.warning("request %s: node %s lost (%s); resuming after %d tokens",
                                request_id, node_id, exc, len(progress.token_ids))
        finally:
            self._awaiting_first_output.discard(request_id)
            self._active.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is None:
            return
        node_id, attempt_id = active
        try:
            await (await self._actor(node_id)).abort.remote(attempt_id)
        except NODE_LOST_ERRORS:
            pass

    async def cluster_info(self) -> dict[str, Any]:
        info = await self._coordinator.cluster_info.remote()
        fresh = await asyncio.gather(*(self._node_stats(row) for row in info["nodes"]))
        nodes = [{**node_entry(row["node_id"], stats or row), **_node_extras(row)} for row, stats in zip(info["nodes"], fresh)]
        summary = summarize_nodes(", ".join(info["models"]), nodes, await self.queue_depth())
        summary["coordinator"] = {k: info[k] for k in ("policy", "index", "routing", "recent_decisions", "uptime_s")}
        summary["resumed_mid_stream"] = self.resumed_mid_stream
        summary["direct_gateway_links"] = self._streams.direct_links  # nodes whose outputs come off Ray now
        summary["route_link"] = self._route_links.connected
        return summary

    async def _node_stats(self, row: dict) -> dict:
        """A live node's counters pulled now (a heartbeat's may be a second old); {} when it does not answer."""
        if row.get("status") != "alive":
            return {}
        try:
            return await asyncio.wait_for((await self._actor(row["node_id"])).stats.remote(), NODE_STATS_TIMEOUT_S)
        except (ValueError, *NODE_LOST_ERRORS):
            self._actors.pop(row["node_id"], None)  # the coordinator says alive: a new actor took the name
            return {}
        except asyncio.TimeoutError:
            return {}

    async def queue_depth(self) -> int:
        return len(self._awaiting_first_output)

    async def shutdown(self) -> None:
        self._closed = True
        self._streams.shutdown()

    # ---- one attempt on one node ---------------------------------------------------
    async def _attempt(self, node_id, request_id, attempt, prompt, params, progress) -> AsyncIterator[RequestOutput]:
        """Stream from one node, turning every sign of its death into NodeLost."""
        attempt_id = request_id if attempt == 0 else f"{request_id}#resume{attempt}"
        attempt_params = resume_params(params, len(progress.token_ids))
        self._active[request_id] = (node_id, attempt_id)
        actor, queue = await self._submit(node_id, attempt_id, prompt, attempt_params)
        finished = prefilled = False
        cumulative = Cumulative(prompt)  # the node streams deltas only
        try:
            while not finished:
                item = await self._next(queue, node_id)
                if isinstance(item, StreamFailed):
                    raise EngineStepFailed(item.message)
                out = replace(cumulative(item), node_id=node_id)
                finished = out.finished
                yield out
                if not prefilled:  # told once the first output is on its way to the client, not before
                    prefilled = True
                    self._prefill_done(node_id, request_id)
        finally:
            self._streams.close(node_id, attempt_id)
            if not prefilled:
                self._prefill_done(node_id, request_id)
            if not finished:
                _abort_on(actor, attempt_id)

    def _prefill_done(self, node_id: str, request_id: str) -> None:
        """Tell the coordinator the request's prefill is no longer queued there: over the route
        link when one is open, else as a Ray call; neither is waited for."""
        if not self._route_links.prefill_done(node_id, request_id):
            self._coordinator.prefill_done.remote(node_id, request_id)

    async def _submit(self, node_id, attempt_id, prompt, params) -> tuple[Any, asyncio.Queue]:
        """Submit to the node's actor: its handle and the queue the outputs arrive on. A cached
        handle whose actor died is looked up again once, since a replacement takes the same name.
        Only a lookup that finds no actor, or a Ray error that says the actor died, loses the node;
        anything else the submission raises is the request's own (the engine's refusal)."""
        for cached in (node_id in self._actors, False):
            try:
                actor = await self._actor(node_id)
            except ValueError as exc:  # no actor by that name any more
                raise NodeLost(repr(exc)) from exc
            queue, receiver = self._streams.open(node_id, actor, attempt_id)  # before submitting: no output is missed
            try:
                if not await self._streams.submit(node_id, actor, attempt_id, prompt, params):  # over the node's link, or
                    await actor.submit.remote(receiver, attempt_id, prompt, params)  # through Ray
                return actor, queue
            except asyncio.CancelledError:  # the client left while the submission was on its way
                self._streams.close(node_id, attempt_id)
                _abort_on(actor, attempt_id)
                raise
            except NODE_LOST_ERRORS as exc:
                self._streams.close(node_id, attempt_id)
                if self._actors.get(node_id) is actor:
                    del self._actors[node_id]  # a handle another request already looked up again stays
                if not cached or not await self._replaced(node_id, actor):
                    raise NodeLost(repr(exc)) from exc
            except Exception:
                self._streams.close(node_id, attempt_id)
                raise
        raise AssertionError("unreachable: the second pass raises or returns")

    async def _replaced(self, node_id: str, actor) -> bool:
        """Whether `node_id`'s name now belongs to another actor than `actor`."""
        if actor is None:
            return False
        try:
            return (await self._actor(node_id))._actor_id != actor._actor_id
        except ValueError:
            return False

    async def _next(self, queue: asyncio.Queue, node_id: str):
        """The request's next item from its node's stream; NodeLost when the node is gone."""
        task = asyncio.ensure_future(next_item(queue))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.stall_check_s)
                if done:
                    return task.result()
                if await self._node_is_dead(node_id):
                    raise NodeLost("node stopped heartbeating")
        finally:
            if not task.done():
                task.cancel()

    async def _route(self, *args) -> RouteDecision:
        """The coordinator's `route`, ridden out as `_ask` rides out its calls: each try over its link
        when there is one (a write and a read), else through Ray."""
        async def once() -> RouteDecision:
            decision = await self._route_links.route(*args)
            return decision if decision is not None else await self._coordinator.route.remote(*args)

        return await ride_out(once, self.config.coordinator_wait_s)

    async def _ask(self, method: str, *args):
        """Call the coordinator, riding out its restart and the moments before nodes re-register."""
        return await ride_out(lambda: getattr(self._coordinator, method).remote(*args), self.config.coordinator_wait_s)

    async def _node_is_dead(self, node_id: str) -> bool:
        try:
            return await self._coordinator.node_status.remote(node_id) in ("dead", None)
        except rex.RayError:
            return False  # the coordinator restarting says nothing about this node

    async def _migrate(self, decision, hashes) -> MigrationOutcome:
        """Have the chosen node pull the plan's blocks before it is asked to generate."""
        plan = decision.migration
        wanted = migration_hashes(plan, decision.cached_blocks, hashes)
        try:
            target, source = await self._actor(decision.node_id), await self._actor(plan.source)
        except (ValueError, *NODE_LOST_ERRORS) as exc:  # the source left since the index saw it
            self._coordinator.migration_failed.remote(decision.node_id, plan.source, repr(exc))
            self.last_migration = MigrationOutcome(ok=False, requested=len(wanted), error=repr(exc), reported=False)
            return self.last_migration
        self.last_migration = await pull_for_request(
            self._coordinator, target, decision.node_id, source, plan.source, wanted, self.config.migration.wait_s(plan)
        )
        return self.last_migration

    # ---- resuming ------------------------------------------------------------------
    def _check_resumable(self, request_id, params, progress, lost) -> None:
        if len(lost) > self.config.max_resumes:
            raise ResumeImpossible(f"request {request_id}: lost {len(lost)} nodes ({', '.join(lost)})")
        if params.n > 1 and progress.streamed:
            # Each choice would need its own continuation of its own text; refusing beats
            # restarting choices whose first tokens the client already has.
            raise ResumeImpossible(f"request {request_id}: lost its node mid-stream; n={params.n} cannot resume")

    def _rebase(self, out: RequestOutput, request_id, prompt, progress: Progress, spec) -> RequestOutput:
        """Make an output of a resumed attempt look like one of the original request."""
        if progress.base_ids and out.outputs:
            first = out.outputs[0]
            merged = replace(
                first,
                token_ids=progress.base_ids + first.token_ids,
                text=progress.base_text + first.text,
                text_delta=progress.unsent_text + first.text_delta,
            )
            progress.unsent_text = ""
            out = replace(out, outputs=[merged, *out.outputs[1:]])
        out = replace(out, request_id=request_id, prompt_token_ids=list(prompt))
        progress.record(out)
        return out

    async def _lose(self, node_id: str, reason: str) -> None:
        self._actors.pop(node_id, None)
        try:
            await self._coordinator.node_failed.remote(node_id, reason)
        except rex.RayError as exc:
            log.warning("could not report node %s lost: %s", node_id, exc)

    # ---- models and handles --------------------------------------------------------
    def _fetch_specs(self, patient: bool):
        """The coordinator's `model_specs` (cluster.gateway.served_models); patient rides out its restart."""
        return self._ask("model_specs") if patient else self._coordinator.model_specs.remote()

    async def _actor(self, node_id: str):
        if node_id not in self._actors:
            name = node_actor_name(node_id)
            self._actors[node_id] = await asyncio.to_thread(ray.get_actor, name, namespace=self.config.namespace)
        return self._actors[node_id]


def _abort_on(actor, request_id: str) -> None:
    """Tell a node to stop a request the client no longer reads (without waiting)."""
    try:
        actor.abort.remote(request_id)
    except Exception as exc:  # the node may already be gone
        log.debug("abort failed: %s", exc)


def _node_extras(row: dict) -> dict:
    keep = ("model", "status", "device", "chip", "memory_bytes", "hostname", "indexed_blocks", "requests_total",
            "prefill_tokens_per_s", "decode_tokens_per_s", "death_reason", "kv_migration_failures")
    return {k: row.get(k) for k in keep}

