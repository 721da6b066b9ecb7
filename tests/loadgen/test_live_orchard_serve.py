"""`orchard bench serve` against a live `orchard serve`: its counts match the server's /metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli.main import main
from tests.loadgen.live_server import free_port, stop, wait_healthy


def counter(base: str, name: str, **labels: str) -> float:
    """Sum of the samples of Prometheus counter `name` whose labels include `labels`."""
    text = httpx.get(base + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module")
def orchard(demo_model_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("orchard_serve") / "serve.log"
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(demo_model_path),
           "--host", "127.0.0.1", "--port", str(port), "--no-ray"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", proc, timeout_s=180)
        yield base
    finally:
        stop(proc)


def test_bench_counts_match_the_servers_metrics(orchard, demo_model_path, tmp_path):
    endpoint = {"endpoint": "/v1/completions", "status": "200"}
    requests_before = counter(orchard, "orchard_requests_total", **endpoint)
    tokens_before = counter(orchard, "orchard_generated_tokens_total")
    out = tmp_path / "orchard.json"
    assert main(["bench", "serve", "--base-url", orchard, "--tokenizer", str(demo_model_path), "--num-prompts", "5",
                 "--input-len", "20", "--output-len", "6", "--max-concurrency", "2", "--no-progress",
                 "--result-file", str(out)]) == 0
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (5, 0)
    assert counter(orchard, "orchard_requests_total", **endpoint) - requests_before == 5
    assert counter(orchard, "orchard_generated_tokens_total") - tokens_before == summary["total_output_tokens"]
