"""What a KV pool reports: block counts, prefix-cache traffic, cold-tier traffic, waste.

Waste follows the vLLM paper: token slots that are allocated but hold no KV, as a share
of the slots allocated. Paged allocation wastes at most the unfilled tail of each
sequence's last block; contiguous preallocation to a maximum length wastes the rest of
that length, which `contiguous_waste` computes for the same workload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVStats:
    """One reading of a pool's counters. Block counts exclude the reserved null block."""

    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    cold_tier_hits: int = 0
    cold_tier_spills: int = 0
    allocated_slots: int = 0
    kv_slots: int = 0

    @property
    def wasted_slots(self) -> int:
        return self.allocated_slots - self.kv_slots

    @property
    def fragmentation(self) -> float:
        """Share of allocated token slots that hold no KV (0.0 when nothing is allocated)."""
        return self.wasted_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def to_dict(self) -> dict:
        """The counters and the two ratios. The counters are ints, so they are read as they are, without
        `dataclasses.asdict`'s deep copy (eight times the time, in the engine call that ends a pull)."""
        return {**vars(self), "fragmentation": self.fragmentation, "prefix_hit_rate": self.prefix_hit_rate}


def contiguous_waste(seq_lens: Iterable[int], max_len: int) -> float:
    """Waste when every sequence preallocates `max_len` contiguous slots."""
    lens = list(seq_lens)
    if any(n > max_len or n < 0 for n in lens):
        raise ValueError(f"sequence lengths must lie in [0, {max_len}]")
    allocated = max_len * len(lens)
    return (allocated - sum(lens)) / allocated if allocated else 0.0


def paged_waste(seq_lens: Iterable[int], block_size: int) -> float:
    """Waste when every sequence holds just enough blocks of `block_size` slots."""
    lens = list(seq_lens)
    allocated = sum(-(-n // block_size) * block_size for n in lens)
    return (allocated - sum(lens)) / allocated if allocated else 0.0
