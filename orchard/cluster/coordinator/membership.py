"""Which nodes exist, which can take work, and how fast each one has been lately.

A node registers once, then heartbeats with its load. Rates (prefill and decode seconds
per token, link bytes per second) arrive as raw measurements and are kept as exponential
moving averages, so one noisy step cannot swing routing. A node that misses heartbeats
for `dead_after_s` is declared dead; a node that registers again starts from scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from orchard.node.rates import Ewma

#: A serving machine's name in the cluster, as its node actor registered it; defined here, imported everywhere else.
NodeId = str


class NodeStatus(str, Enum):
    ALIVE = "alive"
    DRAINING = "draining"
    DEAD = "dead"


class UnknownNode(KeyError):
    """A node id that never registered (or was forgotten, e.g. after a coordinator restart)."""


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself when it registers; fixed for its lifetime."""

    model: str
    block_size: int = 16
    bytes_per_block: int = 0  # K+V bytes of one block over all layers; 0 = unknown
    state_bytes: int = 0  # a hybrid model's recurrent state of one sequence, which travels with each migrated run
    fingerprint: str = ""  # the model fingerprint block hashes are rooted in
    cache_salt: str | None = None
    max_model_len: int = 0
    model_path: str = ""  # where the gateway can load the tokenizer from
    vocab_size: int = 0
    device: str = ""
    hostname: str = ""
    ray_node_id: str = ""
    kv_blocks_total: int = 0
    chip: str = ""
    memory_bytes: int = 0
    kv_link: str = ""  # "host:port" of the node's direct KV listener; "" when it has none
    max_num_seqs: int = 0  # sequences its engine batches at once; 0 = not reported

    @classmethod
    def from_dict(cls, d: dict) -> NodeInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class NodeLoad:
    """One heartbeat's worth of load and rate measurements; rates of None were not measured."""

    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float | None = None
    # What one more prompt token adds to a prefill step (node.rates.StepLine), without the step's fixed cost.
    prefill_marginal_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    requests_total: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> NodeLoad:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class PendingPrefills:
    """Requests routed to a node whose prefill has not been seen to finish: request id ->
    (when routed, prompt tokens to prefill), with their token total kept as they come and go,
    because the router reads that total for every candidate of every decision."""

    def __init__(self):
        self._entries: dict[str, tuple[float, int]] = {}
        self.tokens = 0

    def add(self, request_id: str, at: float, tokens: int) -> None:
        self.pop(request_id)
        self._entries[request_id] = (at, tokens)
        self.tokens += tokens

    def pop(self, request_id: str) -> int | None:
        """The tokens of a request taken out, or None when it was not there."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        self.tokens -= entry[1]
        return entry[1]

    def expire(self, before: float) -> None:
        for request_id in [r for r, (at, _) in self._entries.items() if at < before]:
            self.pop(request_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries


@dataclass
class NodeState:
    node_id: NodeId
    info: NodeInfo
    registered_at: float
    last_heartbeat: float
    status: NodeStatus = NodeStatus.ALIVE
    load: NodeLoad = field(default_factory=NodeLoad)
    prefill_s_per_token: Ewma = field(default_factory=Ewma)
    decode_s_per_token: Ewma = field(default_factory=Ewma)
    rate_evidence: int = 0  # heartbeats whose rates followed new work
    rates_updated_at: float = 0.0
    # Requests routed here whose prefill has not been seen to finish; fresher than any heartbeat.
    pending: PendingPrefills = field(default_factory=PendingPrefills)
    # Prefill tokens seen done since the last heartbeat, which that heartbeat still counts as queued.
    prefilled_since_heartbeat: int = 0
    death_reason: str | None = None
    died_at: float | None = None

    @property
    def queued_prefill_tokens(self) -> int:
        """The node's prefill queue, from the fresher of the two views of it."""
        reported = max(0, self.load.queued_prefill_tokens - self.prefilled_since_heartbeat)
        return max(reported, self.pending_prefill_tokens)

    @property
    def pending_requests(self) -> int:
        return len(self.pending)

    @property
    def pending_prefill_tokens(self) -> int:
        return self.pending.tokens

    @property
    def model(self) -> str:
        return self.info.model

    @property
    def routable(self) -> bool:
        return self.status is NodeStatus.ALIVE


@dataclass(frozen=True)
class MembershipConfig:
    dead_after_s: float = 5.0
    rate_alpha: float = 0.3
    # Routed work whose prefill is not reported done within this long is assumed abandoned.
    pending_ttl_s: float = 60.0
    # A dead node is kept (status "dead", for callers asking about it) this long, then forgotten.
    forget_dead_after_s: float = 60.0


class Membership:
    """The registry of nodes, their status, load and measured rates."""

    def __init__(self, config: MembershipConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or MembershipConfig()
        self._clock = clock
        self._nodes: dict[NodeId, NodeState] = {}
        # (source, target) -> bytes per second moved between them.
        self._links: dict[tuple[NodeId, NodeId], Ewma] = {}

    def register(self, node_id: NodeId, info: NodeInfo) -> NodeState:
        """Add a node, or reset one that comes back: a rejoining node starts with no history."""
        now = self._clock()
        alpha = self.config.rate_alpha
        state = NodeState(
            node_id,
            info,
            registered_at=now,
            last_heartbeat=now,
            prefill_s_per_token=Ewma(alpha),
            decode_s_per_token=Ewma(alpha),
        )
        self._nodes[node_id] = state
        return state

    def heartbeat(self, node_id: NodeId, load: NodeLoad) -> NodeState:
        """Record load and fold measured rates into the node's moving averages."""
        state = self.get(node_id)
        if state.status is NodeStatus.DEAD:
            raise UnknownNode(node_id)
        previous = state.load
        new_evidence = (state.rate_evidence == 0 or load.requests_total > previous.requests_total
                        or (load.prefill_tokens_per_s, load.decode_tokens_per_s)
                        != (previous.prefill_tokens_per_s, previous.decode_tokens_per_s))
        state.last_heartbeat = self._clock()
        state.load = load
        state.prefilled_since_heartbeat = 0
        self._expire_pending(state)
        if new_evidence and (load.prefill_tokens_per_s or load.decode_tokens_per_s):
            # An idle node repeats its last rates: only new work or a changed rate is new evidence.
            state.rate_evidence += 1
            state.rates_updated_at = state.last_heartbeat
            if load.prefill_tokens_per_s:
                state.prefill_s_per_token.update(1.0 / load.prefill_tokens_per_s)
            if load.decode_tokens_per_s:
                state.decode_s_per_token.update(1.0 / load.decode_tokens_per_s)
        return state

    def note_routed(self, node_id: NodeId, request_id: str, prefill_tokens: int) -> None:
        """Count a request's prefill as work queued on the node until it is seen to finish."""
        self.get(node_id).pending.add(request_id, self._clock(), prefill_tokens)

    def prefill_done(self, node_id: NodeId, request_id: str) -> None:
        state = self._nodes.get(node_id)
        tokens = state.pending.pop(request_id) if state is not None else None
        if tokens is not None:
            state.prefilled_since_heartbeat += tokens

    def _expire_pending(self, state: NodeState) -> None:
        """Forget entries nobody closed (a gateway that died mid-request)."""
        state.pending.expire(self._clock() - self.config.pending_ttl_s)

    def record_link_rate(self, source: NodeId, target: NodeId, bytes_per_s: float) -> None:
        if bytes_per_s > 0:
            self._links.setdefault((source, target), Ewma(self.config.rate_alpha)).update(bytes_per_s)

    def link_rate(self, source: NodeId, target: NodeId) -> float | None:
        """Measured bytes/s from source to target, or None if never measured."""
        avg = self._links.get((source, target))
        return avg.value if avg else None

    def reap(self) -> list[NodeId]:
        """Declare dead every live node whose last heartbeat is too old; return them. Nodes
        dead for longer than `forget_dead_after_s` are forgotten, so that a cluster whose
        machines come and go does not report every machine it ever had."""
        now = self._clock()
        deadline = now - self.config.dead_after_s
        late = [s.node_id for s in self._nodes.values() if s.status is not NodeStatus.DEAD and s.last_heartbeat < deadline]
        for node_id in late:
            self.mark_dead(node_id, "missed heartbeats")
        forget_before = now - self.config.forget_dead_after_s
        for state in [s for s in self._nodes.values() if s.died_at is not None and s.died_at < forget_before]:
            self.forget(state.node_id)
        return late

    def mark_dead(self, node_id: NodeId, reason: str) -> bool:
        """Stop routing to a node; returns False if it was already dead or unknown."""
        state = self._nodes.get(node_id)
        if state is None or state.status is NodeStatus.DEAD:
            return False
        state.status = NodeStatus.DEAD
        state.death_reason = reason
        state.died_at = self._clock()
        for link in [k for k in self._links if node_id in k]:
            del self._links[link]
        return True

    def drain(self, node_id: NodeId) -> NodeState:
        state = self.get(node_id)
        if state.status is NodeStatus.ALIVE:
            state.status = NodeStatus.DRAINING
        return state

    def undrain(self, node_id: NodeId) -> NodeState:
        state = self.get(node_id)
        if state.status is NodeStatus.DRAINING:
            state.status = NodeStatus.ALIVE
        return state

    def forget(self, node_id: NodeId) -> None:
        self._nodes.pop(node_id, None)

    def get(self, node_id: NodeId) -> NodeState:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UnknownNode(node_id) from None

    def candidates(self, model: str) -> list[NodeState]:
        """Nodes that may take a new request for `model`."""
        return [s for s in self._nodes.values() if s.routable and s.model == model]

    def models(self) -> list[str]:
        return sorted({s.model for s in self._nodes.values() if s.routable})

    def nodes(self) -> list[NodeState]:
        return list(self._nodes.values())

    def __contains__(self, node_id: NodeId) -> bool:
        return node_id in self._nodes
