"""Pick the node for a request: the one that will produce its first token soonest.

Under the `prefix` policy each candidate's cost is an estimate in seconds:

    fill(node) + uncached tokens x prefill s/token(node) + load(node)
    load(node) = queued prefill tokens x prefill s/token + running decodes x decode s/token

where `fill` covers blocks another node holds beyond this node's own prefix: the cheaper
of recomputing them here, priced at what their tokens add to the request's prefill step (the
node's marginal cost per token: the step and its fixed cost come either way), and pulling them
over the measured link (a migration: the link's fixed cost, the measured overhead around a
pull and the bytes), which must win by more than the tie band below. Rates are
moving averages fed by heartbeats after new work, shrunk toward the cluster's mean by how
little evidence they rest on and how long ago it was gathered: a node that never got work
after one slow sample is not frozen as slow, and is tried again. A node not measured at all
borrows the mean; only when none is measured does the configured prior apply. Costs within
TIE_TOLERANCE (and TIE_FLOOR_S) of the lowest count as a tie, won by the node holding most of
the prompt in its own cache, then by the node with the most free KV blocks (exact ties at
random), so repeats stay with their holder, new prefixes spread over the pools and the
cluster's cache is the sum of its nodes'. The other policies exist to measure against and ignore the prefix. Every
policy returns a node whenever at least one candidate exists.

A request naming a session (a client's conversation key) goes, under the `prefix` policy, to
the node that served the session's last request while that node is routable and has room for
it (a free sequence slot and KV blocks for what it does not hold); otherwise the cost decides
and the session moves with it. An agent's turns thus keep meeting their own cache even before
the node's KV events reach the prefix index.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from orchard.cluster.coordinator.membership import NodeId, NodeState

POLICIES = ("prefix", "round_robin", "least_loaded", "random")

#: Costs this close to the lowest (relative, plus an absolute floor in seconds) are a tie,
#: won by the node holding most of the prompt itself, then by free KV capacity. The floor
#: covers what a heartbeat's staleness can add (about one engine step of a finished request).
TIE_TOLERANCE = 0.1
TIE_FLOOR_S = 0.005
#: Sessions whose last node is remembered (least recently routed forgotten first).
SESSIONS_KEPT = 10_000
#: Heartbeats of evidence that weigh as much as the cluster's mean rate.
EVIDENCE_PRIOR = 2
#: A node's own rates lose half their weight against the mean per this many idle seconds.
RATE_HALF_LIFE_S = 60.0

LinkRate = Callable[[NodeId, NodeId], "float | None"]
#: Blocks of KV the coordinator knows a node holds (its prefix index).
HeldBlocks = Callable[[NodeId], int]
#: Fixed seconds a migration over a link costs its request besides its bytes: the pull's own
#: (round trips, hand-offs) and the caller's call to the target around it.
LinkLatency = Callable[[NodeId, NodeId], float]


class NoNodeAvailable(LookupError):
    """No live, non-draining node serves the requested model."""

    def __init__(self, model: str):
        super().__init__(f"no node available for model {model!r}")
        self.model = model


class UnknownPolicy(ValueError):
    """A routing policy name outside POLICIES."""


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"
    # Used only while no node of the cluster has reported a rate yet.
    prior_prefill_s_per_token: float = 1e-3
    prior_decode_s_per_token: float = 1e-2
    decisions_kept: int = 256
    seed: int | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise UnknownPolicy(f"unknown router policy {self.policy!r}; expected one of {POLICIES}")


@dataclass(frozen=True)
class MigrationPlan:
    """Pull `num_blocks` blocks (after the target's own leading ones) from `source`."""

    source: NodeId
    num_blocks: int
    est_transfer_s: float
    est_recompute_s: float


@dataclass(frozen=True)
class RouteRequest:
    model: str
    num_tokens: int
    block_size: int
    held: dict[NodeId, int]  # leading blocks of the prompt each node holds (PrefixIndex.match)
    request_id: str = ""
    prefix: str = ""  # a short name for the prompt's first block, so prompts sharing it can be grouped
    session: str = ""  # the client's conversation key ("" = none): its requests stay on one node while it has room


@dataclass(frozen=True)
class RouteDecision:
    node_id: NodeId
    cached_blocks: int
    reason: str  # "session" | "prefix-hit" | "migrate" | "load" | "only-node" | "round-robin" | "least-loaded" | "random"
    policy: str
    est_cost_s: float
    num_candidates: int
    migration: MigrationPlan | None = None
    request_id: str = ""
    decided_at: float = 0.0
    latency_s: float = 0.0
    prefix: str = ""  # RouteRequest.prefix

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Rates:
    prefill: float  # seconds per token
    decode: float
    prefill_marginal: float  # seconds one more prompt token adds to a step (the migrate-or-recompute choice)


@dataclass(frozen=True)
class _Costed:
    node: NodeState
    cost: float
    own_blocks: int
    migration: MigrationPlan | None


class Router:
    """Ranks candidates by estimated time to first token; keeps recent decisions."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._rng = random.Random(self.config.seed)
        self._rr = itertools.count()
        self.recent: deque[RouteDecision] = deque(maxlen=self.config.decisions_kept)
        self._sessions: OrderedDict[str, NodeId] = OrderedDict()  # session -> the node of its last request

    def route(
        self,
        request: RouteRequest,
        candidates: Sequence[NodeState],
        link_rate: LinkRate = lambda source, target: None,
        policy: str | None = None,
        link_latency: LinkLatency = lambda source, target: 0.0,
        held_blocks: HeldBlocks = lambda node_id: 0,
    ) -> RouteDecision:
        started = time.perf_counter()
        policy = policy or self.config.policy
        if policy not in POLICIES:
            raise UnknownPolicy(f"unknown router policy {policy!r}; expected one of {POLICIES}")
        if not candidates:
            raise NoNodeAvailable(request.model)
        rates = self._rates(candidates)
        if policy == "prefix":
            link = (link_rate, link_latency)
            decision = self._by_session(request, candidates, rates, link, held_blocks) \
                or self._by_cost(request, candidates, rates, link, held_blocks)
        else:
            decision = self._by_policy(policy, request, candidates, rates)
        self._remember(request.session, decision.node_id)
        decision = _stamp(decision, request, started)
        self.recent.append(decision)
        return decision

    def load_seconds(self, candidates: Sequence[NodeState]) -> dict[NodeId, tuple[float, float]]:
        """Per candidate: (seconds of work queued ahead of a new request, prefill s/token)."""
        rates = self._rates(candidates)
        return {n.node_id: (_load_s(n, rates[n.node_id]), rates[n.node_id].prefill) for n in candidates}

    def session_node(self, session: str) -> NodeId | None:
        """The node that served the session's last request, if it is remembered."""
        return self._sessions.get(session)

    # ---- sessions ------------------------------------------------------------------
    def _by_session(self, request, candidates, rates, link, held_blocks) -> RouteDecision | None:
        """The session's last node, when it is still a candidate and has room; else None (the cost decides)."""
        node_id = self._sessions.get(request.session) if request.session else None
        node = next((c for c in candidates if c.node_id == node_id), None)
        if node is None or not _has_room(node, request, held_blocks):
            return None
        costed = self._cost(request, node, rates[node.node_id], link)
        return RouteDecision(node.node_id, costed.own_blocks, "session", "prefix", costed.cost, len(candidates), costed.migration)

    def _remember(self, session: str, node_id: NodeId) -> None:
        if not session:
            return
        self._sessions[session] = node_id
        self._sessions.move_to_end(session)
        while len(self._sessions) > SESSIONS_KEPT:
            self._sessions.popitem(last=False)

    # ---- prefix policy -------------------------------------------------------------
    def _by_cost(self, request, candidates, rates, link, held_blocks) -> RouteDecision:
        costed = [self._cost(request, node, rates[node.node_id], link) for node in candidates]
        lowest = min(c.cost for c in costed)
        near = [c for c in costed if ties(c.cost, lowest)]
        # Within the band, the node holding most of the prompt itself wins: a prefix hit is
        # never traded for room, nor for a migration whose estimated gain is within noise.
        held_most = max(c.own_blocks for c in near)
        near = [c for c in near if c.own_blocks == held_most]
        room = {c.node.node_id: _free_blocks(c.node, held_blocks) for c in near}
        most = max(room.values())
        winner = self._rng.choice([c for c in near if room[c.node.node_id] >= most])
        if winner.migration:
            reason = "migrate"
        elif len(candidates) == 1:
            reason = "only-node"
        elif winner.own_blocks:
            reason = "prefix-hit"
        else:
            reason = "load"
        return RouteDecision(
            winner.node.node_id, winner.own_blocks, reason, "prefix", winner.cost, len(candidates), winner.migration
        )

    def _cost(self, request: RouteRequest, node: NodeState, rates: _Rates, link: tuple) -> _Costed:
        bs = request.block_size
        prompt_blocks = request.num_tokens // bs
        own = min(request.held.get(node.node_id, 0), prompt_blocks)
        migration = self._migration(request, node, own, rates, link)
        covered = own + (migration.num_blocks if migration else 0)
        fill = migration.est_transfer_s if migration else 0.0
        # The last prompt token is always computed: its logits start decoding.
        uncached = max(1, request.num_tokens - covered * bs)
        cost = fill + uncached * rates.prefill + _load_s(node, rates)
        return _Costed(node, cost, own, migration)

    def _migration(self, request, node, own, rates, link) -> MigrationPlan | None:
        """Pull from the best other holder when the measured link beats recomputing."""
        link_rate, link_latency = link
        prompt_blocks = request.num_tokens // request.block_size
        source, source_blocks = _best_other_holder(request.held, node.node_id)
        extra = min(source_blocks, prompt_blocks) - own
        if source is None or extra <= 0 or node.info.bytes_per_block <= 0:
            return None
        bytes_per_s = link_rate(source, node.node_id)
        if not bytes_per_s:
            return None
        run_bytes = extra * node.info.bytes_per_block + node.info.state_bytes
        transfer_s = link_latency(source, node.node_id) + run_bytes / bytes_per_s
        recompute_s = extra * request.block_size * rates.prefill_marginal  # the request's step runs either way
        if ties(recompute_s, transfer_s):
            return None  # a gain within the estimates' noise: recompute, with no pull that could fail or stall
        return MigrationPlan(source, extra, transfer_s, recompute_s)

    # ---- baseline policies ---------------------------------------------------------
    def _by_policy(self, policy, request, candidates, rates) -> RouteDecision:
        if policy == "round_robin":
            ordered = sorted(candidates, key=lambda n: n.node_id)
            node = ordered[next(self._rr) % len(ordered)]
        elif policy == "least_loaded":
            loads = [(_load_s(n, rates[n.node_id]), n) for n in candidates]
            lowest = min(load for load, _ in loads)
            node = self._rng.choice([n for load, n in loads if load <= lowest])
        else:
            node = self._rng.choice(list(candidates))
        own = min(request.held.get(node.node_id, 0), request.num_tokens // request.block_size)
        reason = "only-node" if len(candidates) == 1 else policy.replace("_", "-")
        cost = max(1, request.num_tokens - own * request.block_size) * rates[node.node_id].prefill
        return RouteDecision(node.node_id, own, reason, policy, cost + _load_s(node, rates[node.node_id]), len(candidates))

    # ---- rates ---------------------------------------------------------------------
    def _rates(self, candidates: Sequence[NodeState]) -> dict[NodeId, _Rates]:
        prefill_default = _mean([n.prefill_s_per_token.value for n in candidates], self.config.prior_prefill_s_per_token)
        decode_default = _mean([n.decode_s_per_token.value for n in candidates], self.config.prior_decode_s_per_token)
        rates = {}
        for n in candidates:
            prefill = _shrunk(n.prefill_s_per_token.value, prefill_default, _confidence(n))
            decode = _shrunk(n.decode_s_per_token.value, decode_default, _confidence(n))
            rates[n.node_id] = _Rates(prefill, decode, _marginal(n, prefill))
        return rates


def ties(cost: float, lowest: float) -> bool:
    """Whether `cost` is within the tie band of `lowest`: the one band for ranking nodes and for a
    migration against recomputing (both compare estimates no finer than the band)."""
    return cost <= lowest * (1 + TIE_TOLERANCE) + TIE_FLOOR_S


def _confidence(node: NodeState) -> float:
    """Weight of a node's own rates against the cluster mean: more evidence, more weight; idle time decays it."""
    idle_s = max(0.0, node.last_heartbeat - node.rates_updated_at)
    evidence = node.rate_evidence
    return evidence / (evidence + EVIDENCE_PRIOR) * 0.5 ** (idle_s / RATE_HALF_LIFE_S)


def _marginal(node: NodeState, prefill: float) -> float:
    """Seconds one more prompt token adds to the node's prefill step, as the node last measured
    it; its average cost per token (which carries each step's fixed cost) until it has."""
    measured = node.load.prefill_marginal_tokens_per_s
    return 1.0 / measured if measured else prefill


def _shrunk(own: float | None, mean: float, weight: float) -> float:
    return mean if not own else weight * own + (1 - weight) * mean


def _free_blocks(node: NodeState, held_blocks: HeldBlocks) -> int:
    """Blocks of the node's pool not holding KV the coordinator knows of, less its routed prefills."""
    total = node.load.kv_blocks_total or node.info.kv_blocks_total
    return total - max(held_blocks(node.node_id), node.load.kv_blocks_used) - node.pending_prefill_tokens // max(node.info.block_size, 1)


def _has_room(node: NodeState, request: RouteRequest, held_blocks: HeldBlocks) -> bool:
    """A free sequence slot and free KV blocks for the part of the prompt the node does not hold
    (each checked when the node reported its size)."""
    seqs = node.load.running + max(node.load.waiting, node.pending_requests)
    if node.info.max_num_seqs and seqs >= node.info.max_num_seqs:
        return False
    needed = -(-request.num_tokens // request.block_size) - request.held.get(node.node_id, 0)
    known = node.load.kv_blocks_total or node.info.kv_blocks_total
    return not known or _free_blocks(node, held_blocks) >= needed


def _load_s(node: NodeState, rates: _Rates) -> float:
    """Seconds of work already ahead of a new request on `node`.

    The prefill queue comes from `NodeState.queued_prefill_tokens`, which reconciles the
    last heartbeat with what was routed or finished since.
    """
    return node.queued_prefill_tokens * rates.prefill + node.load.running * rates.decode


def _best_other_holder(held: dict[NodeId, int], exclude: NodeId) -> tuple[NodeId | None, int]:
    best, best_blocks = None, 0
    for node_id, blocks in held.items():
        if node_id != exclude and blocks > best_blocks:
            best, best_blocks = node_id, blocks
    return best, best_blocks


def _mean(values, default: float) -> float:
    measured = [v for v in values if v]
    return sum(measured) / len(measured) if measured else default


def _stamp(decision: RouteDecision, request: RouteRequest, started: float) -> RouteDecision:
    return replace(decision, request_id=request.request_id, prefix=request.prefix, decided_at=time.time(),
                   latency_s=time.perf_counter() - started)
