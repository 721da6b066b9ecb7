"""The head's brain: membership, the cluster prefix index and the router in one object.

`Coordinator` is a plain class so it is tested without Ray; `orchard.cluster.coordinator.service`
makes it the Ray actor deployed once per cluster as the named, detached actor
`orchard-coordinator` in namespace `orchard`. Its methods are synchronous and the actor
runs them one at a time, so the state needs no locks.

Conversation with a node: `register_node` (the reply asks for a snapshot, so a node that
registers again after a coordinator restart refills the index at once), then per engine
step `kv_events` (False means "send a snapshot"), and `heartbeat` with its load (the reply
says whether the coordinator still knows the node, wants a snapshot, or drains it, and
carries block moves the node should hand to other nodes: hot-prefix copies and drain).
Migrations report back with `migration_report` (counters, and the measured link rate), and
their callers with `migration_overhead` (what the step cost beyond the pull);
a joining node asks `link_peers` whom to probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from orchard.cluster.coordinator.link_cost import LinkCostFit, MigrationOverhead
from orchard.cluster.coordinator.membership import Membership, MembershipConfig, NodeId, NodeInfo, NodeLoad, NodeStatus, UnknownNode
from orchard.cluster.coordinator.pending_prefixes import PendingPrefixes
from orchard.cluster.coordinator.prefix_index import PrefixIndex
from orchard.cluster.coordinator.replication import BlockMove, NodeLoadView, ReplicationConfig, ReplicationPlanner
from orchard.cluster.coordinator.router import RouteDecision, Router, RouterConfig, RouteRequest
from orchard.kvcache.events import PackedEvents
from orchard.kvcache.hashing import BlockHash

COORDINATOR_NAME = "orchard-coordinator"
NAMESPACE = "orchard"


@dataclass(frozen=True)
class CoordinatorConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    pending_prefix_ttl_s: float = 30.0  # how long a routed prefix counts as held before its node reports it
    link_token: str | None = None  # the cluster's secret for the route link; None: the Ray token in the environment


@dataclass
class _RoutingTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens the chosen node already held when routed
    migrations: int = 0
    block_moves: int = 0  # hot-prefix copies and drain moves handed to nodes
    by_reason: dict[tuple[NodeId, str], int] = field(default_factory=dict)  # (node, reason) -> decisions


@dataclass
class _MigrationCounts:
    """Per target node: blocks it imported from other nodes, and pulls that broke off."""

    blocks: int = 0
    failures: int = 0


class Coordinator:
    def __init__(self, config: CoordinatorConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or CoordinatorConfig()
        self.membership = Membership(self.config.membership, clock)
        self.index = PrefixIndex()
        self.pending = PendingPrefixes(self.config.pending_prefix_ttl_s, clock)
        self.router = Router(self.config.router)
        self.replication = ReplicationPlanner(self.config.replication)
        self._clock = clock
        self._totals = _RoutingTotals()
        self._started = time.time()
        self._actor_names: dict[NodeId, str] = {}
        self._moves: dict[NodeId, list[dict]] = {}  # source node -> moves for its next heartbeat
        self._migrated: dict[NodeId, _MigrationCounts] = {}
        self._links: dict[tuple[NodeId, NodeId], LinkCostFit] = {}  # (source, target) -> cost line
        self._overheads: dict[tuple[NodeId, NodeId], MigrationOverhead] = {}  # (source, target) -> beyond the pull

    # ---- nodes talking to the coordinator ------------------------------------------
    def register_node(self, node_id: NodeId, info: NodeInfo | dict) -> dict:
        """Add (or reset) a node; its index entries come only from the snapshot it sends next."""
        if isinstance(info, dict):
            if info.get("actor_name"):
                self._actor_names[node_id] = info["actor_name"]
            info = NodeInfo.from_dict(info)
        self.membership.register(node_id, info)
        self._moves.pop(node_id, None)
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
            "moves": self._moves.pop(node_id, []),
        }

    def kv_events(self, node_id: NodeId, events: PackedEvents) -> bool:
        """Apply a node's events of one or more steps, packed as its actor sends them; False asks the node for a snapshot."""
        if not self._is_live(node_id):
            return True  # a dead or unknown node re-registers first; nothing to ask for
        return self.index.apply(node_id, events.unpack())

    def kv_snapshot(self, node_id: NodeId, seq: int, blocks: Iterable[tuple[BlockHash, str]]) -> None:
        if self._is_live(node_id):
            self.index.load_snapshot(node_id, seq, blocks)

    def record_link_rate(self, source: NodeId, target: NodeId, bytes_per_s: float) -> None:
        self.membership.record_link_rate(source, target, bytes_per_s)

    def migration_report(self, target: NodeId, report: dict) -> None:
        """A node's pull finished: count it, and fold its effective rate into the link's average."""
        counts = self._migrated.setdefault(target, _MigrationCounts())
        counts.blocks += int(report.get("imported", 0))
        counts.failures += not report.get("ok", True)
        if report.get("ok", True) and report.get("bytes_per_s") and report.get("source"):
            self.record_transfer(report["source"], target, float(report["bytes"]), float(report["seconds"]),
                                 str(report.get("via", "ray")))

    def record_transfer(self, source: NodeId, target: NodeId, nbytes: float, seconds: float, via: str = "ray") -> None:
        """One measured move of `nbytes` (a pull or a probe) over path `via`: feeds the link's rate and
        fixed cost; the first move over another path than the fit's starts the pair's fit afresh."""
        if nbytes > 0 and seconds > 0:
            self.membership.record_link_rate(source, target, nbytes / seconds)
            fit = self._links.get((source, target))
            if fit is None or fit.path != via:
                fit = self._links[(source, target)] = LinkCostFit(path=via)
            fit.add(nbytes, seconds)

    def migration_failed(self, target: NodeId, source: NodeId, reason: str) -> None:
        """A pull that could not report itself (the call to the target failed)."""
        self._migrated.setdefault(target, _MigrationCounts()).failures += 1

    def link_peers(self, node_id: NodeId) -> list[dict]:
        """Live nodes of the same model that `node_id` should probe the link with."""
        if node_id not in self.membership:
            return []
        model = self.membership.get(node_id).model
        return [
            {"node_id": peer.node_id, "actor_name": self._actor_names[peer.node_id]}
            for peer in self.membership.candidates(model)
            if peer.node_id != node_id and peer.node_id in self._actor_names
        ]

    def link_rate(self, source: NodeId, target: NodeId) -> float | None:
        """Bytes/s of the link's fitted cost line, else the plain average of reported rates."""
        fit = self._links.get((source, target))
        if fit is not None and self.membership.link_rate(source, target) is not None:
            return fit.bytes_per_s
        return self.membership.link_rate(source, target)

    def migration_overhead(self, source: NodeId, target: NodeId, nbytes: float, seconds: float) -> None:
        """A caller's migration step of `nbytes` took `seconds` beyond the pull its target reported
        (`orchard.cluster.gateway.block_pull`): the fixed cost that the link's fit never sees."""
        self._overheads.setdefault((source, target), MigrationOverhead()).add(nbytes, seconds)

    def link_latency(self, source: NodeId, target: NodeId) -> float:
        """Fixed seconds a migration over the link costs its request: the fit's per-pull latency
        plus the measured overhead around the pull (a pair not measured yet borrows the mean of
        the pairs that were: it is mostly the caller's hops, not the link)."""
        fit = self._links.get((source, target))
        pull = fit.latency_s if fit is not None and self.membership.link_rate(source, target) is not None else 0.0
        return pull + self._overhead_s(source, target)

    def _overhead_s(self, source: NodeId, target: NodeId) -> float:
        own = self._overheads.get((source, target))
        if own is not None:
            return own.fixed_s
        measured = [o.fixed_s for o in self._overheads.values()]
        return sum(measured) / len(measured) if measured else 0.0

    def kv_link(self, node_id: NodeId) -> str | None:
        """Where `node_id`'s direct KV listener is ("host:port"), None when it has none or is unknown."""
        return (self.membership.get(node_id).info.kv_link or None) if node_id in self.membership else None

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
        session: str = "",
    ) -> RouteDecision:
        """Choose a node for a prompt; `exclude` skips nodes a resumed request just lost; a
        `session` (the client's conversation key) stays on its last node while that has room."""
        self.reap()
        candidates = [n for n in self.membership.candidates(model) if n.node_id not in exclude]
        hybrid = set(_resume_at_states(candidates))
        # a hybrid node's run grows past its last state only through blocks routed to it (pending),
        # whose prompt ends on a state; what the index holds beyond that state it cannot resume from
        held = self.pending.extend(self.index.match(block_hashes, hybrid), block_hashes,
                                   lambda node, h: node not in hybrid and self._index_holds(node, h))
        request = RouteRequest(model, num_tokens, block_size, held, request_id, prefix_name(block_hashes), session)
        decision = self.router.route(request, candidates, self.link_rate, policy, self.link_latency, self.index.node_block_count)
        self.pending.note(decision.node_id, block_hashes)
        uncached = max(1, num_tokens - decision.cached_blocks * block_size)
        self.membership.note_routed(decision.node_id, request_id or f"anonymous-{self._totals.requests}", uncached)
        self._count(decision, num_tokens, block_size)
        move = self.replication.on_arrival(block_hashes, held, lambda: self._load_views(candidates), block_size, self._clock())
        if move is not None:
            self._queue_move(move)
        return decision

    def prefill_done(self, node_id: NodeId, request_id: str) -> None:
        """A routed request produced its first token (or ended): its prefill no longer waits."""
        self.membership.prefill_done(node_id, request_id)

    def node_failed(self, node_id: NodeId, reason: str = "actor died") -> bool:
        """Someone saw the node die (a failed call, a lost stream): stop routing to it now."""
        return self._declare_dead(node_id, reason)

    def drain(self, node_id: NodeId) -> dict:
        """Stop routing to the node and hand its most-used prefixes to the others."""
        state = self.membership.drain(node_id)
        targets = self._load_views(self.membership.candidates(state.model))
        for move in self.replication.evacuate(node_id, self.match, targets):
            self._queue_move(move)
        return self._row(state)

    def undrain(self, node_id: NodeId) -> dict:
        return self._row(self.membership.undrain(node_id))

    def pending_moves(self, node_id: NodeId) -> list[dict]:
        """Moves waiting for the node's next heartbeat (without taking them)."""
        return list(self._moves.get(node_id, []))

    def set_policy(self, policy: str) -> None:
        self.router = Router(RouterConfig(**{**self.router.config.__dict__, "policy": policy}))

    def reap(self) -> list[NodeId]:
        dead = self.membership.reap()
        for node_id in dead:
            self.index.remove_node(node_id)
            self.pending.forget_node(node_id)
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
        """Leading blocks of a prompt each node holds (a hybrid model's node: up to its last state),
        without routing anything."""
        return self.index.match(block_hashes, _resume_at_states(self.membership.nodes()))

    def indexed_blocks(self, node_id: NodeId) -> int:
        return self.index.node_block_count(node_id)

    def node_status(self, node_id: NodeId) -> str | None:
        """'alive', 'draining', 'dead', or None for a node never seen."""
        self.reap()
        return self.membership.get(node_id).status.value if node_id in self.membership else None

    def nodes(self) -> list[dict]:
        self.reap()
        return [self._row(state) for state in self.membership.nodes()]

    def recent_decisions(self, limit: int = 50) -> list[dict]:
        return [d.to_dict() for d in list(self.router.recent)[-limit:]]

    def cluster_info(self) -> dict:
        totals = self._totals
        stats = self.index.stats()
        return {
            "uptime_s": time.time() - self._started,
            "policy": self.router.config.policy,
            "models": self.models(),
            # Serving nodes only: a dead node's last figures would be reported as current.
            "nodes": [row for row in self.nodes() if row["status"] != NodeStatus.DEAD.value],
            "index": {"blocks": stats.blocks, "entries": stats.entries, "gaps_seen": stats.gaps_seen,
                      "events_applied": stats.events_applied, "awaiting_snapshot": stats.nodes_awaiting_snapshot},
            "routing": {
                "requests": totals.requests,
                "prompt_tokens": totals.prompt_tokens,
                "routed_cached_tokens": totals.cached_tokens,
                "routed_hit_rate": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
                "migrations": totals.migrations,
                "block_moves": totals.block_moves,
                "decisions": [{"node": node, "reason": reason, "count": count}
                              for (node, reason), count in sorted(totals.by_reason.items())],
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
        self.pending.forget_node(node_id)
        return changed

    def _index_holds(self, node_id: NodeId, block_hash: BlockHash) -> bool:
        return node_id in self.index.holders(block_hash)

    def _load_views(self, candidates) -> list[NodeLoadView]:
        return [NodeLoadView(n, load, prefill) for n, (load, prefill) in self.router.load_seconds(candidates).items()]

    def _queue_move(self, move: BlockMove) -> None:
        target_actor = self._actor_names.get(move.target)
        if target_actor is None:
            return  # the target cannot be reached by name (not a Ray node actor)
        self._moves.setdefault(move.source, []).append(
            {"target": move.target, "target_actor": target_actor, "hashes": list(move.hashes), "reason": move.reason}
        )
        self._totals.block_moves += 1

    def _row(self, state) -> dict:
        counts = self._migrated.get(state.node_id, _MigrationCounts())
        return {**_node_row(state, self.index), "kv_migrated_blocks": counts.blocks, "kv_migration_failures": counts.failures}

    def _count(self, decision: RouteDecision, num_tokens: int, block_size: int) -> None:
        self._totals.requests += 1
        self._totals.prompt_tokens += num_tokens
        self._totals.cached_tokens += decision.cached_blocks * block_size
        self._totals.migrations += decision.migration is not None
        key = (decision.node_id, decision.reason)
        self._totals.by_reason[key] = self._totals.by_reason.get(key, 0) + 1


def prefix_name(block_hashes: Sequence[BlockHash]) -> str:
    """The first block's hash, shortened: prompts that share their first block share this name."""
    return bytes(block_hashes[0])[:6].hex() if block_hashes else ""


def _node_row(state, index: PrefixIndex) -> dict:
    load = state.load
    hit_rate = load.prefix_hit_tokens / load.prefix_query_tokens if load.prefix_query_tokens else 0.0
    return {
        "node_id": state.node_id,
        "model": state.model,
        "status": state.status.value,
        "device": state.info.device,
        "chip": state.info.chip,
        "memory_bytes": state.info.memory_bytes,
        "hostname": state.info.hostname,
        "ray_node_id": state.info.ray_node_id,
        "waiting": load.waiting,
        "running": load.running,
        "kv_blocks_used": load.kv_blocks_used,
        "kv_blocks_total": load.kv_blocks_total or state.info.kv_blocks_total,
        "max_num_seqs": state.info.max_num_seqs,
        "indexed_blocks": index.node_block_count(state.node_id),
        "prefix_hit_rate": hit_rate,
        "prefix_hit_tokens": load.prefix_hit_tokens,
        "prefix_query_tokens": load.prefix_query_tokens,
        "requests_total": load.requests_total,
        "prefill_tokens_per_s": 1.0 / state.prefill_s_per_token.value if state.prefill_s_per_token.value else None,
        "decode_tokens_per_s": 1.0 / state.decode_s_per_token.value if state.decode_s_per_token.value else None,
        "prefill_marginal_tokens_per_s": load.prefill_marginal_tokens_per_s,
        "death_reason": state.death_reason,
    }



def _resume_at_states(nodes) -> list[NodeId]:
    """The nodes serving a hybrid model: their KV resumes a prompt only where they hold a state."""
    return [n.node_id for n in nodes if n.info.state_bytes]
