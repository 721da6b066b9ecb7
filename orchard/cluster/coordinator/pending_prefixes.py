"""Prefixes a node is about to hold: routed there, not yet reported.

A node announces a block only after it has computed it, so for the length of a prefill
the index does not know that the node will hold the prefix. Under a burst, the next
requests of the same tenant arrive in that window, see no holder anywhere, and the
router spreads them by load — each node then computes the same prefix. The coordinator
therefore remembers, for a short while, which prefix it just sent where, and counts it
as held there. The index itself stays built from KV events only; these entries expire
on their own (a request that fails never reports its blocks) and vanish with their node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from orchard.cluster.coordinator.membership import NodeId
from orchard.kvcache.hashing import BlockHash


class PendingPrefixes:
    def __init__(self, ttl_s: float, clock: Callable[[], float]):
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: dict[NodeId, dict[BlockHash, float]] = {}

    def note(self, node_id: NodeId, hashes: Sequence[BlockHash]) -> None:
        """`node_id` was just given a prompt with these full-block hashes (ttl 0: remember nothing)."""
        if self.ttl_s <= 0:
            return
        until = self._clock() + self.ttl_s
        entries = self._expiry.setdefault(node_id, {})
        for block_hash in hashes:
            entries[block_hash] = until

    def forget_node(self, node_id: NodeId) -> None:
        self._expiry.pop(node_id, None)

    def extend(self, held: Mapping[NodeId, int], hashes: Sequence[BlockHash], holds: Callable[[NodeId, BlockHash], bool]) -> dict[NodeId, int]:
        """`held` (leading blocks per node, from the index) lengthened by what each node will hold.

        A node's run continues through block i when the index says it holds block i
        (`holds`) or the block is pending there; only nodes with pending entries are walked.
        """
        out = dict(held)
        now = self._clock()
        for node_id, entries in list(self._expiry.items()):
            run = held.get(node_id, 0)
            while run < len(hashes):
                expiry = entries.get(hashes[run])
                if expiry is not None and expiry < now:
                    del entries[hashes[run]]
                    expiry = None
                if expiry is None and not holds(node_id, hashes[run]):
                    break
                run += 1
            if run:
                out[node_id] = run
            if not entries:
                del self._expiry[node_id]
        return out

    def __len__(self) -> int:
        return sum(len(e) for e in self._expiry.values())
