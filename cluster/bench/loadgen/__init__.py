"""Load generator for any OpenAI-compatible endpoint (`orchard bench serve`).

Modules, one job each: `prompts` (text of a length), `datasets` (workloads),
`arrivals` (when requests are due), `client` (one timed streamed request), `runner`
(drives a workload), `metrics` (figures), `report` (the JSON document and its table),
`compare` (two documents side by side), `plots` (PNG figures), `benchmark` (all of it).
"""

from cluster.loadgen.benchmark import ServeBenchConfig, run_bench
from cluster.loadgen.client import EndpointConfig, RequestRecord
from cluster.loadgen.datasets import DatasetConfig
from cluster.loadgen.metrics import SLO, summarize
from cluster.loadgen.prompts import LengthRange
from cluster.loadgen.runner import LoadConfig

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
