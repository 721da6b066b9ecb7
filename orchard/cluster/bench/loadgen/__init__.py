"""Load generator for any OpenAI-compatible endpoint (`orchard bench serve`).

Modules, one job each: `prompts` (text of a length), `datasets` (workloads),
`arrivals` (when requests are due), `client` (one timed streamed request), `runner`
(drives a workload), `metrics` (figures), `report` (the JSON document and its table),
`compare` (two documents side by side), `plots` (PNG figures), `config` (what one run is
asked to do), `benchmark` (all of it).
"""

from orchard.cluster.bench.loadgen.benchmark import run_bench
from orchard.cluster.bench.loadgen.client import EndpointConfig, RequestRecord
from orchard.cluster.bench.loadgen.config import ServeBenchConfig
from orchard.cluster.bench.loadgen.datasets import DatasetConfig
from orchard.cluster.bench.loadgen.metrics import SLO, summarize
from orchard.cluster.bench.loadgen.prompts import LengthRange
from orchard.cluster.bench.loadgen.runner import LoadConfig

__all__ = [
    "DatasetConfig",
    "EndpointConfig",
    "LengthRange",
    "LoadConfig",
    "RequestRecord",
    "SLO",
    "ServeBenchConfig",
    "run_bench",
    "summarize",
]
