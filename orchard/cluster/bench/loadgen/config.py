"""What one `bench serve` invocation is asked to do: target, workload, load, SLOs."""

from __future__ import annotations

from dataclasses import dataclass

from orchard.cluster.bench.loadgen.client import EndpointConfig
from orchard.cluster.bench.loadgen.datasets import DatasetConfig
from orchard.cluster.bench.loadgen.metrics import SLO
from orchard.cluster.bench.loadgen.runner import LoadConfig


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one `bench serve` invocation needs."""

    endpoint: EndpointConfig
    dataset: DatasetConfig
    load: LoadConfig
    tokenizer: str | None = None
    slo: SLO | None = None
    sweep_concurrency: tuple[int, ...] = ()
    progress: bool = True
    save_text: bool = False

    @property
    def levels(self) -> tuple[int | None, ...]:
        return self.sweep_concurrency or (self.load.max_concurrency,)
