"""Copying KV blocks ahead of demand: hot prefixes and draining nodes.

Two situations make the coordinator move blocks without a request waiting for them:

- a prefix keeps arriving while the node holding it is saturated (the work queued there
  takes longer than recomputing the prefix would), so later requests would either queue
  behind the holder or recompute elsewhere: copy it to the least-loaded other node now;
- a node is drained: its most-used prefixes go to the other nodes before it leaves, so
  the cluster keeps their hits.

This module only decides (plain data, no Ray). The coordinator hands each `BlockMove` to
the source node with its next heartbeat reply; the source asks the target to pull.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from orchard.cluster.coordinator.membership import NodeId
from orchard.kvcache.hashing import BlockHash


@dataclass(frozen=True)
class ReplicationConfig:
    hot_arrivals: int = 3  # arrivals within `window_s` that make a prefix hot
    window_s: float = 60.0
    cooldown_s: float = 30.0  # a prefix just copied is not copied again before this
    tracked_prefixes: int = 4096  # usage is kept for this many prefixes, least recent dropped
    drain_prefixes: int = 32  # most-used prefixes a draining node hands out


@dataclass(frozen=True)
class BlockMove:
    """`target` should pull the blocks of `hashes` (a prefix run) from `source`."""

    source: NodeId
    target: NodeId
    hashes: tuple[BlockHash, ...]
    reason: str  # "hot-prefix" | "drain"


@dataclass(frozen=True)
class NodeLoadView:
    """What the planner needs of a candidate node: its queued work and prefill speed."""

    node_id: NodeId
    load_s: float
    prefill_s_per_token: float


@dataclass
class _Usage:
    hashes: tuple[BlockHash, ...]
    uses: int = 0
    arrivals: deque = field(default_factory=deque)  # arrival times inside the window
    copied_at: float | None = None


class ReplicationPlanner:
    """Counts how often each prefix arrives and proposes copies of hot or stranded ones."""

    def __init__(self, config: ReplicationConfig | None = None):
        self.config = config or ReplicationConfig()
        self._usage: OrderedDict[BlockHash, _Usage] = OrderedDict()  # keyed by the prefix's last hash

    def on_arrival(
        self,
        hashes: Sequence[BlockHash],
        held: Mapping[NodeId, int],
        candidates: Callable[[], Sequence[NodeLoadView]],
        block_size: int,
        now: float,
    ) -> BlockMove | None:
        """Record a prompt's arrival; return a copy to make if its prefix is hot and its holder saturated.

        `candidates` gives the nodes' loads when called: only a hot prefix needs them, so an
        ordinary arrival costs the router no second pass over the cluster's rates."""
        holder, blocks = _deepest_holder(held)
        if holder is None or blocks == 0:
            return None
        usage = self._record(tuple(hashes[:blocks]), now)
        if len(usage.arrivals) < self.config.hot_arrivals or self._cooling(usage, now):
            return None
        views = candidates()
        loads = {c.node_id: c for c in views}
        if holder not in loads or not _saturated(loads[holder], blocks * block_size):
            return None
        target = _least_loaded([c for c in views if held.get(c.node_id, 0) < blocks])
        if target is None:
            return None
        usage.copied_at = now
        return BlockMove(holder, target.node_id, usage.hashes, "hot-prefix")

    def evacuate(
        self, node_id: NodeId, held_by: Callable[[Sequence[BlockHash]], Mapping[NodeId, int]], targets: Sequence[NodeLoadView]
    ) -> list[BlockMove]:
        """Moves for the most-used prefixes `node_id` holds, spread over `targets` least loaded first."""
        others = sorted((t for t in targets if t.node_id != node_id), key=lambda t: t.load_s)
        if not others:
            return []
        moves: list[BlockMove] = []
        for usage in sorted(self._usage.values(), key=lambda u: -u.uses):
            if len(moves) >= self.config.drain_prefixes:
                break
            held = held_by(usage.hashes)
            blocks = held.get(node_id, 0)
            if blocks == 0 or any(held.get(t.node_id, 0) >= blocks for t in others):
                continue  # not here, or another node keeps it anyway
            target = others[len(moves) % len(others)]
            moves.append(BlockMove(node_id, target.node_id, usage.hashes[:blocks], "drain"))
        return moves

    def uses(self, hashes: Sequence[BlockHash]) -> int:
        usage = self._usage.get(hashes[-1]) if hashes else None
        return usage.uses if usage else 0

    # ---- internals -----------------------------------------------------------------
    def _record(self, hashes: tuple[BlockHash, ...], now: float) -> _Usage:
        key = hashes[-1]
        usage = self._usage.get(key)
        if usage is None:
            usage = self._usage[key] = _Usage(hashes)
            while len(self._usage) > self.config.tracked_prefixes:
                self._usage.popitem(last=False)
        self._usage.move_to_end(key)
        usage.uses += 1
        usage.arrivals.append(now)
        while usage.arrivals and usage.arrivals[0] < now - self.config.window_s:
            usage.arrivals.popleft()
        return usage

    def _cooling(self, usage: _Usage, now: float) -> bool:
        return usage.copied_at is not None and now - usage.copied_at < self.config.cooldown_s


def _saturated(holder: NodeLoadView, prefix_tokens: int) -> bool:
    """The holder's queue takes longer than recomputing the prefix would: its cache no longer helps."""
    return holder.load_s > prefix_tokens * holder.prefill_s_per_token


def _deepest_holder(held: Mapping[NodeId, int]) -> tuple[NodeId | None, int]:
    best, blocks = None, 0
    for node_id, count in sorted(held.items()):
        if count > blocks:
            best, blocks = node_id, count
    return best, blocks


def _least_loaded(candidates: Sequence[NodeLoadView]) -> NodeLoadView | None:
    return min(candidates, key=lambda c: (c.load_s, c.node_id), default=None)
