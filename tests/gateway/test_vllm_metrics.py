"""A live `orchard serve --no-ray`'s /metrics against what Grafana dashboards query.

vLLM's own dashboard (vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json,
moved to examples/observability/prometheus_grafana/ later) queries the families listed
below, each filtered by `model_name`; the later version swaps time_per_output_token for
inter_token_latency and gpu_cache_usage_perc for kv_cache_usage_perc. After a couple of
requests every one of them is present here with its type and labels, so either version of
that dashboard works as it is. The project's own dashboard (deploy/grafana/orchard.json) is loaded too, and every
metric its queries name must exist in the same scrape.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ORCHARD = Path(sys.executable).with_name("orchard")
GRAFANA = ROOT / "deploy" / "grafana" / "orchard.json"
MODEL = "tiny-served"

# What vLLM's Grafana dashboard queries: family -> (type, labels its queries use or group by).
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:time_per_output_token_seconds": ("histogram", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:gpu_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_prefill_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_decode_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_max_num_generation_tokens": ("histogram", {"model_name"}),
}
# The later dashboard's names for two of them, and other vLLM names for figures this server has.
VLLM_NEWER = {
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:num_preemptions": ("counter", {"model_name"}),
    "vllm:request_inference_time_seconds": ("histogram", {"model_name"}),
}
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--no-ray", "--port", "0", "--kv-memory", "0.02",
                                 "--served-model-name", MODEL, "--max-model-len", "128"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        match = re.search(r"at (http://\S+)/v1", proc.stdout.readline())
        assert match, log.read_text()[-3000:]
        url = match.group(1)
        prompt = "the same words each time so the second one hits the prefix cache " * 2
        for stream in (False, True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        yield {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("family", sorted({**VLLM_DASHBOARD, **VLLM_NEWER}))
def test_every_family_vllms_dashboard_queries_is_scraped_with_its_type_and_labels(scrape, family):
    kind, labels = {**VLLM_DASHBOARD, **VLLM_NEWER}[family]
    assert family in scrape, f"{family} missing"
    assert scrape[family].type == kind
    samples = [s for s in scrape[family].samples if not s.name.endswith("_created")]
    assert samples, f"{family} has no samples after two requests"
    for s in samples:
        assert labels | {"node"} <= set(s.labels), (s.name, s.labels)
        assert s.labels["model_name"] == MODEL and s.labels["node"] == "local"


def test_two_requests_are_counted_as_two_finished_requests_with_their_tokens(scrape):
    def total(family: str, suffix: str) -> float:
        return sum(s.value for s in scrape[family].samples if s.name == family + suffix)

    assert total("vllm:request_success", "_total") == 2
    assert total("vllm:e2e_request_latency_seconds", "_count") == 2
    assert total("vllm:request_generation_tokens", "_sum") == 12
    assert total("vllm:prefix_cache_hits", "_total") > 0  # the second prompt reused the first one's blocks
    assert total("vllm:generation_tokens", "_total") >= 12  # the engine's own count (warm-up included)
    usage = scrape["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= usage <= 1.0


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: ours all start `vllm:` or `orchard_`."""
    return set(re.findall(r"\b(?:vllm:|orchard_)[a-zA-Z0-9_:]*", expr))


def family_of(name: str, scrape: dict) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in scrape:
            return name.removesuffix(suffix)
    return name


def test_the_projects_grafana_dashboard_queries_only_metrics_the_server_exposes(scrape):
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"KV cache use by node", "Prefix cache hit rate by node", "Routing decisions by reason",
            "KV migrations", "Time to first token by node", "Inter-token latency by node"} <= titles
    named = set().union(*(metric_names(e) for e in exprs))
    assert len(named) >= 14 and "orchard_queue_depth" in named
    missing = sorted(n for n in named if family_of(n, scrape) not in scrape)
    assert not missing, missing
