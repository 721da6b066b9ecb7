"""Which node holds which prefix block, learnt only from the nodes' KV events.

The index is a flat dict `block hash -> {node id: tier bits}` rather than a tree: block
hashes are already chained (a hash names its whole prefix), so a lookup walks the
prompt's hashes in order with one dict probe each and stops at the first block no node
holds. Cost and memory depend on the prompt and on how many copies a block has, never on
how many nodes the cluster has. A reverse map `node -> its hashes` makes dropping a node
(or replacing it with a snapshot) proportional to that node's blocks alone.

Each node's events carry sequence numbers without holes; a hole means an event was lost,
so the node's entries can no longer be trusted until it sends a full snapshot.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchard.cluster.coordinator.membership import NodeId
from orchard.kvcache.events import DISK, MEMORY, STATE, BlockRemoved, BlockStored, KVEvent
from orchard.kvcache.hashing import BlockHash

#: One bit per tier so a block held in memory and on disk at once costs one int; STATE marks a
#: hybrid model's block that has the recurrent state after it (kvcache.events).
TIER_BITS = {MEMORY: 1, DISK: 2, STATE: 4}


def best_tier(bits: int) -> str:
    """The fastest tier among `bits`: memory beats disk."""
    return MEMORY if bits & TIER_BITS[MEMORY] else DISK


class UnknownTier(ValueError):
    """An event or snapshot named a tier the index has no bit for."""


def _tier_bit(tier: str) -> int:
    try:
        return TIER_BITS[tier]
    except KeyError:
        raise UnknownTier(f"unknown KV tier {tier!r}; expected one of {sorted(TIER_BITS)}") from None


@dataclass(frozen=True)
class IndexStats:
    blocks: int  # distinct hashes held somewhere
    entries: int  # (hash, node) pairs
    nodes: int
    nodes_awaiting_snapshot: int
    events_applied: int
    gaps_seen: int


class PrefixIndex:
    """Cluster-wide map of cached prefix blocks, fed by per-node event streams."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, dict[NodeId, int]] = {}
        self._by_node: dict[NodeId, set[BlockHash]] = {}
        self._next_seq: dict[NodeId, int] = {}
        self._awaiting_snapshot: set[NodeId] = set()
        self._entries = 0
        self._events_applied = 0
        self._gaps_seen = 0

    # ---- feeding -------------------------------------------------------------------
    def apply(self, node_id: NodeId, events: Sequence[KVEvent]) -> bool:
        """Apply one batch of a node's events in order.

        Returns False when the batch does not follow on from what was seen before (or the
        node already owes a snapshot): the node is then marked as needing a snapshot and
        the rest of the batch is ignored, since the snapshot will cover it. Events older
        than what was already applied (a re-sent batch) are skipped.
        """
        if node_id in self._awaiting_snapshot:
            return False
        expected = self._next_seq.get(node_id, 0)
        for event in events:
            if event.seq < expected:
                continue
            if event.seq > expected:
                self._gaps_seen += 1
                self._awaiting_snapshot.add(node_id)
                self._next_seq[node_id] = expected
                return False
            self._apply_one(node_id, event)
            expected += 1
        self._next_seq[node_id] = expected
        return True

    def _apply_one(self, node_id: NodeId, event: KVEvent) -> None:
        bit = _tier_bit(event.tier)
        if isinstance(event, BlockStored):
            self._add(node_id, event.block_hash, bit)
        elif isinstance(event, BlockRemoved):
            self._discard(node_id, event.block_hash, bit)
        else:
            raise TypeError(f"not a KV event: {event!r}")
        self._events_applied += 1

    def load_snapshot(self, node_id: NodeId, seq: int, blocks: Iterable[tuple[BlockHash, str]]) -> None:
        """Replace everything known about `node_id` with a full snapshot.

        `seq` is the node's next sequence number when the snapshot was taken: events below
        it are already reflected and will be skipped if they arrive late.
        """
        self._drop_entries(node_id)
        self._by_node[node_id] = set()
        for block_hash, tier in blocks:
            self._add(node_id, block_hash, _tier_bit(tier))
        self._next_seq[node_id] = seq
        self._awaiting_snapshot.discard(node_id)

    def require_snapshot(self, node_id: NodeId) -> None:
        """Drop a node's entries and ignore its events until its next snapshot arrives."""
        self.remove_node(node_id)
        self._awaiting_snapshot.add(node_id)

    def remove_node(self, node_id: NodeId) -> None:
        """Forget a node entirely (dead, or rejoining with an empty pool)."""
        self._drop_entries(node_id)
        self._next_seq.pop(node_id, None)
        self._awaiting_snapshot.discard(node_id)

    def _add(self, node_id: NodeId, block_hash: BlockHash, bit: int) -> None:
        holders = self._holders.setdefault(block_hash, {})
        if node_id not in holders:
            self._entries += 1
            self._by_node.setdefault(node_id, set()).add(block_hash)
        holders[node_id] = holders.get(node_id, 0) | bit

    def _discard(self, node_id: NodeId, block_hash: BlockHash, bit: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is None or node_id not in holders:
            return
        remaining = holders[node_id] & ~bit
        if remaining:
            holders[node_id] = remaining
            return
        del holders[node_id]
        self._entries -= 1
        self._by_node[node_id].discard(block_hash)
        if not holders:
            del self._holders[block_hash]

    def _drop_entries(self, node_id: NodeId) -> None:
        for block_hash in self._by_node.pop(node_id, ()):
            holders = self._holders[block_hash]
            del holders[node_id]
            self._entries -= 1
            if not holders:
                del self._holders[block_hash]

    # ---- asking --------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash], resume_at_states: Collection[NodeId] = ()) -> dict[NodeId, int]:
        """Number of leading blocks of `hashes` each node holds (nodes holding none are absent).

        A node counts block i only if it held blocks 0..i-1 too; the walk ends at the first
        block nobody holds, or once no node is still on an unbroken run. A node of
        `resume_at_states` (one serving a hybrid model) counts its run only up to the last
        block it holds a state for: past that its KV cannot resume a prompt.
        """
        counts = self._runs(hashes)
        for node_id in set(resume_at_states) & counts.keys():
            usable = self._resumable(node_id, hashes, counts[node_id])
            if usable:
                counts[node_id] = usable
            else:
                del counts[node_id]
        return counts

    def _resumable(self, node_id: NodeId, hashes: Sequence[BlockHash], run: int) -> int:
        state = TIER_BITS[STATE]
        for count in range(run, 0, -1):
            if self._holders[hashes[count - 1]].get(node_id, 0) & state:
                return count
        return 0

    def _runs(self, hashes: Sequence[BlockHash]) -> dict[NodeId, int]:
        counts: dict[NodeId, int] = {}
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            extended = False
            for node_id in holders:
                if counts.get(node_id, 0) == i:
                    counts[node_id] = i + 1
                    extended = True
            if not extended:
                break
        return counts

    def holders(self, block_hash: BlockHash) -> dict[NodeId, str]:
        """Nodes holding one block, each with its fastest tier."""
        return {node: best_tier(bits) for node, bits in self._holders.get(block_hash, {}).items()}

    def needs_snapshot(self, node_id: NodeId) -> bool:
        return node_id in self._awaiting_snapshot

    def next_seq(self, node_id: NodeId) -> int:
        """The sequence number the index expects next from `node_id`."""
        return self._next_seq.get(node_id, 0)

    def node_block_count(self, node_id: NodeId) -> int:
        return len(self._by_node.get(node_id, ()))

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def num_entries(self) -> int:
        return self._entries

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._holders),
            entries=self._entries,
            nodes=len(self._by_node),
            nodes_awaiting_snapshot=len(self._awaiting_snapshot),
            events_applied=self._events_applied,
            gaps_seen=self._gaps_seen,
        )

    def per_node_blocks(self) -> Mapping[NodeId, int]:
        return {node: len(hashes) for node, hashes in self._by_node.items()}
