"""The head's brain: membership, the cluster prefix index and the router in one object.

`Coordinator` is a plain class so it is tested without Ray; `CoordinatorActor` is the same
class as a Ray actor, deployed once per cluster as the named, detached actor
`orchard-coordinator` in namespace `orchard`. Its methods are synchronous and the actor
runs them one at a time, so the state needs no locks.

Conversation with a node: `register_node` (the reply asks for a snapshot, so a node that
registers again after a coordinator restart refills the index at once), then per engine
step `kv_events` (False means "send a snapshot"), and `heartbeat` with its load (the reply
says whether the coordinator still knows the node, wants a snapshot, or drains it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import ray

from cluster.membership import Membership, MembershipConfig, NodeId, NodeInfo, NodeLoad, NodeStatus, UnknownNode
from cluster.prefix_index import PrefixIndex
from cluster.router import RouteDecision, Router, RouterConfig, RouteRequest
from kvcache.events import KVEvent
from kvcache.hashing import BlockHash

COORDINATOR_NAME = "orchard-coordinator"
NAMESPACE = "orchard"


@dataclass(frozen=True)
class CoordinatorConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)


@dataclass
class _RoutingTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens the chosen node already held when routed
    migrations: int = 0


class Coordinator:
    def __init__(self, config: CoordinatorConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or CoordinatorConfig()
        self.membership = Membership(self.config.membership, clock)
        self.index = PrefixIndex()
        self.router = Router(self.config.router)
        self._totals = _RoutingTotals()
        self._started = time.time()

    # ---- nodes talking to the coordinator ------------------------------------------
    def register_node(self, node_id: NodeId, info: NodeInfo | dict) -> dict:
        """Add (or reset) a node; its index entries come only from the snapshot it sends next."""
        if isinstance(info, dict):
            info = NodeInfo.from_dict(info)
        self.membership.register(node_id, info)
        self.index.require_snapshot(node_id)
        return {"snapshot": True}

    def heartbeat(self, node_id: NodeId, load: NodeLoad | dict) -> dict:
        if isinstance(load, dict):
            load = NodeLoad.from_dict(load)
        self.reap()
        try:
            state = self.membership.heartbeat(node_id, load)
        except UnknownNode:
            return {"known": False, "snapshot": False, "draining": False}
        return {
            "known": True,
            "snapshot": self.index.needs_snapshot(node_id),
            "draining": state.status is NodeStatus.DRAINING,
        }

    def kv_events(self, node_id: NodeId, events: Sequence[KVEvent]) -> bool:
        """Apply one step's events; False asks the node for a snapshot."""
        if not self._is_live(node_id):
            return True  # a dead or unknown node re-registers first; nothing to ask for
        return self.index.apply(node_id, events)

    def kv_snapshot(self, node_id: NodeId, seq: int, blocks: Iterable[tuple[BlockHash, str]]) -> None:
        if self._is_live(node_id):
            self.index.load_snapshot(node_id, seq, blocks)

    def record_link_rate(self, source: NodeId, target: NodeId, bytes_per_s: float) -> None:
        self.membership.record_link_rate(source, target, bytes_per_s)

    # ---- the gateway asking --------------------------------------------------------
    def route(
        self,
        model: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        block_size: int,
        request_id: str = "",
        policy: str | None = None,
        exclude: Sequence[NodeId] = (),
    ) -> RouteDecision:
        """Choose a node for a prompt; `exclude` skips nodes a resumed request just lost."""
        self.reap()
        candidates = [n for n in self.membership.candidates(model) if n.node_id not in exclude]
        held = self.index.match(block_hashes)
        request = RouteRequest(model, num_tokens, block_size, held, request_id)
        decision = self.router.route(request, candidates, self.membership.link_rate, policy)
        uncached = max(1, num_tokens - decision.cached_blocks * block_size)
        self.membership.note_routed(decision.node_id, request_id or f"anonymous-{self._totals.requests}", uncached)
        self._count(decision, num_tokens, block_size)
        return decision

    def prefill_done(self, node_id: NodeId, request_id: str) -> None:
        """A routed request produced its first token (or ended): its prefill no longer waits."""
        self.membership.prefill_done(node_id, request_id)

    def node_failed(self, node_id: NodeId, reason: str = "actor died") -> bool:
        """Someone saw the node die (a failed call, a lost stream): stop routing to it now."""
        return self._declare_dead(node_id, reason)

    def drain(self, node_id: NodeId) -> dict:
        return _node_row(self.membership.drain(node_id), self.index)

    def undrain(self, node_id: NodeId) -> dict:
        return _node_row(self.membership.undrain(node_id), self.index)

    def set_policy(self, policy: str) -> None:
        self.router = Router(RouterConfig(**{**self.router.config.__dict__, "policy": policy}))

    def reap(self) -> list[NodeId]:
        dead = self.membership.reap()
        for node_id in dead:
            self.index.remove_node(node_id)
        return dead

    # ---- looking -------------------------------------------------------------------
    def models(self) -> list[str]:
        return self.membership.models()

    def model_specs(self) -> dict[str, dict]:
        """Per served model, what a gateway needs to hash prompts as the nodes do."""
        specs: dict[str, dict] = {}
        for state in self.membership.nodes():
            if state.routable and state.model not in specs:
                specs[state.model] = asdict(state.info)
        return specs

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[NodeId, int]:
        """Leading blocks of a prompt each node holds, without routing anything."""
        return self.index.match(block_hashes)

    def indexed_blocks(self, node_id: NodeId) -> int:
        return self.index.node_block_count(node_id)

    def node_status(self, node_id: NodeId) -> str | None:
        """'alive', 'draining', 'dead', or None for a node never seen."""
        self.reap()
        return self.membership.get(node_id).status.value if node_id in self.membership else None

    def nodes(self) -> list[dict]:
        self.reap()
        return [_node_row(state, self.index) for state in self.membership.nodes()]

    def recent_decisions(self, limit: int = 50) -> list[dict]:
        return [d.to_dict() for d in list(self.router.recent)[-limit:]]

    def cluster_info(self) -> dict:
        totals = self._totals
        stats = self.index.stats()
        return {
            "uptime_s": time.time() - self._started,
            "policy": self.router.config.policy,
            "models": self.models(),
            "nodes": self.nodes(),
            "index": {"blocks": stats.blocks, "entries": stats.entries, "gaps_seen": stats.gaps_seen,
                      "events_applied": stats.events_applied, "awaiting_snapshot": stats.nodes_awaiting_snapshot},
            "routing": {
                "requests": totals.requests,
                "prompt_tokens": totals.prompt_tokens,
                "routed_cached_tokens": totals.cached_tokens,
                "routed_hit_rate": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
                "migrations": totals.migrations,
            },
            "recent_decisions": self.recent_decisions(20),
        }

    def ping(self) -> bool:
        return True

    # ---- internals -----------------------------------------------------------------
    def _is_live(self, node_id: NodeId) -> bool:
        return node_id in self.membership and self.membership.get(node_id).status is not NodeStatus.DEAD

    def _declare_dead(self, node_id: NodeId, reason: str) -> bool:
        changed = self.membership.mark_dead(node_id, reason)
        self.index.remove_node(node_id)
        return changed

    def _count(self, decision: RouteDecision, num_tokens: int, block_size: int) -> None:
        self._totals.requests += 1
        self._totals.prompt_tokens += num_tokens
        self._totals.cached_tokens += decision.cached_blocks * block_size
        self._totals.migrations += decision.migration is not None


def _node_row(state, index: PrefixIndex) -> dict:
    load = state.load
    hit_rate = load.prefix_hit_tokens / load.prefix_query_tokens if load.prefix_query_tokens else 0.0
    return {
        "node_id": state.node_id,
        "model": state.model,
        "status": state.status.value,
        "device": state.info.device,
        "hostname": state.info.hostname,
        "ray_node_id": state.info.ray_node_id,
        "waiting": load.waiting,
        "running": load.running,
        "kv_blocks_used": load.kv_blocks_used,
        "kv_blocks_total": load.kv_blocks_total or state.info.kv_blocks_total,
        "indexed_blocks": index.node_block_count(state.node_id),
        "prefix_hit_rate": hit_rate,
        "prefix_hit_tokens": load.prefix_hit_tokens,
        "prefix_query_tokens": load.prefix_query_tokens,
        "requests_total": load.requests_total,
        "prefill_tokens_per_s": 1.0 / state.prefill_s_per_token.value if state.prefill_s_per_token.value else None,
        "decode_tokens_per_s": 1.0 / state.decode_s_per_token.value if state.decode_s_per_token.value else None,
        "death_reason": state.death_reason,
    }


CoordinatorActor = ray.remote(Coordinator)
