"""From per-request records to the figures a serving benchmark reports.

Latencies are reported in milliseconds as distributions (mean, std, min, max, p50,
p90, p99) so that tails are visible; throughputs are per second of wall time of the
whole run, because that is what a user of the server experiences. Goodput counts only
requests that met every given service-level objective.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from orchard.cluster.bench.loadgen.client import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2el")


class BadSLO(ValueError):
    """A `--goodput` item is not `metric:milliseconds` with a known metric."""


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits in milliseconds; None means no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLO | None:
        """`["ttft:500", "tpot:50"]` -> SLO(ttft_ms=500, tpot_ms=50); None when empty."""
        if not items:
            return None
        limits: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise BadSLO(f"goodput item {item!r} must be one of {', '.join(k + ':MS' for k in SLO_KEYS)}")
            try:
                limits[f"{key}_ms"] = float(value)
            except ValueError as exc:
                raise BadSLO(f"goodput item {item!r}: {value!r} is not a number of milliseconds") from exc
        return cls(**limits)

    def met(self, rec: RequestRecord) -> bool:
        """True when the request succeeded and stayed within every limit given.

        A one-token reply has no TPOT, so a TPOT limit cannot be broken by it; a reply
        without any text has no TTFT and fails a TTFT limit.
        """
        if not rec.success:
            return False
        if self.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1000 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and rec.tpot_s is not None and rec.tpot_s * 1000 > self.tpot_ms:
            return False
        return self.e2el_ms is None or (rec.e2el_s is not None and rec.e2el_s * 1000 <= self.e2el_ms)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric in milliseconds; fields are None when count is 0."""

    count: int
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(count=0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(x) for x in np.percentile(ms, [50, 90, 99]))
        return cls(len(ms), float(ms.mean()), float(ms.std()), float(ms.min()), float(ms.max()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    """Everything `bench serve` reports for one run (one concurrency level)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    token_count_source: str
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    errors: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    ok = [r for r in records if r.success]
    inputs = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=len(ok) * per_s,
        output_throughput=outputs * per_s,
        total_token_throughput=(inputs + outputs) * per_s,
        goodput=None if slo is None else sum(slo.met(r) for r in ok) * per_s,
        token_count_source=_count_source(ok),
        ttft_ms=Distribution.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el_ms=Distribution.of_seconds([r.e2el_s for r in ok if r.e2el_s is not None]),
        errors=dict(Counter(_error_kind(r.error) for r in records if r.error is not None).most_common(10)),
    )


def _count_source(ok: list[RequestRecord]) -> str:
    sources = {r.token_source for r in ok}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")


def _error_kind(error: str) -> str:
    return error[:120]
