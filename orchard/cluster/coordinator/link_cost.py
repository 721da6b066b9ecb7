"""What moving KV blocks over one link costs, learnt from the transfers that went over it.

The router weighs a migration against recomputing the prefix with this estimate; the
nodes report each pull's bytes and seconds, and the coordinator keeps one fit per link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchard.node.rates import WeightedLine


@dataclass
class LinkCostFit:
    """`seconds = latency + bytes / rate` for one link, fitted to recent transfers.

    A pull pays a fixed cost (round trips, two engine-thread hand-offs) besides its bytes;
    a rate alone would make a two-block pull look nearly free. Exponentially weighted
    moments give a least-squares line that follows the link as it changes. Until
    transfers of different sizes were seen, the line goes through the origin.

    One fit per (source, target) and path: the direct KV link and Ray's object store are
    different pipelines (several times apart in rate), so samples of one never fit the other.
    """

    path: str = "ray"  # which path the samples went over: "ray" or "direct" (`orchard.node.serving.kv_link`)
    line: WeightedLine = field(default_factory=lambda: WeightedLine(alpha=0.3))  # seconds over bytes

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.line.add(nbytes, seconds)

    @property
    def samples(self) -> int:
        return self.line.samples

    @property
    def _slope(self) -> float:
        """Seconds per byte: the line's, or through the origin until transfers of different sizes gave one."""
        slope = self.line.slope()
        return slope if slope is not None else self.line.mean_y / self.line.mean_x

    @property
    def bytes_per_s(self) -> float | None:
        return 1.0 / self._slope if self.samples else None

    @property
    def latency_s(self) -> float:
        return max(0.0, self.line.mean_y - self._slope * self.line.mean_x) if self.samples else 0.0

    def estimate_s(self, nbytes: float) -> float | None:
        """Seconds a move of `nbytes` is expected to take over this link; None before any sample."""
        return self.latency_s + nbytes * self._slope if self.samples else None


@dataclass
class MigrationOverhead:
    """Seconds a migration costs its request beyond the pull itself, as the caller waited them:
    the call to the target and its reply (Ray hops, the target's hand-offs before and after the
    pull), which no pull and no probe sees. A short prefix recomputes in a few milliseconds, so
    this fixed cost decides its case.

    Part of it grows with the pull (on the 2-core VM, ~3 ms around a 2-block pull of the small
    demo model, 6-12 ms around a 512-block one), so it is fitted as a line over the pull's bytes
    and only its fixed part is priced: the per-byte part is small beside the pull's own.
    Samples of one size, or no line with a fixed cost: their mean.
    """

    line: WeightedLine = field(default_factory=lambda: WeightedLine(alpha=0.3))  # seconds over bytes

    def add(self, nbytes: float, seconds: float) -> None:
        self.line.add(max(nbytes, 1.0), max(seconds, 1e-6))

    @property
    def fixed_s(self) -> float:
        line = self.line
        if not line.samples:
            return 0.0
        slope = line.slope()
        return line.mean_y if slope is None else line.mean_y - slope * line.mean_x
