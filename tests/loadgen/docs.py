"""Result documents built from hand-made records through the real report code."""

from __future__ import annotations

from orchard.cluster.bench.loadgen.client import EndpointConfig
from orchard.cluster.bench.loadgen.config import ServeBenchConfig
from orchard.cluster.bench.loadgen.datasets import DatasetConfig
from orchard.cluster.bench.loadgen.metrics import SLO
from orchard.cluster.bench.loadgen.prompts import WordPrompts
from orchard.cluster.bench.loadgen.report import result_document
from orchard.cluster.bench.loadgen.runner import LoadConfig, RunResult
from tests.loadgen.records import record


def document(levels=(None,), ttft=0.1, gap=0.02, n=4, duration_s=2.0, base_url="http://a"):
    """One run per level: `n` records of TTFT `ttft` and two gaps of `gap` (3 tokens each)."""
    cfg = ServeBenchConfig(EndpointConfig(base_url, "m"), DatasetConfig(), LoadConfig(num_prompts=n),
                           slo=SLO(ttft_ms=1000), sweep_concurrency=tuple(x for x in levels if x))
    runs = [RunResult([record(ttft=ttft * (1 + i / 10), itl=(gap, gap), conv=i) for i in range(n)],
                      duration_s, level) for level in levels]
    return result_document(cfg, cfg.endpoint, WordPrompts(), runs)
