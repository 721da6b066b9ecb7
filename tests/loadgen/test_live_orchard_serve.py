"""`orchard bench serve` against a live `orchard serve`: its counts match the server's /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchard.cluster.cli.main import main
from orchard.node.openblas import find_openblas
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
def orchard_process(demo_model_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("orchard_serve") / "serve.log"
    cmd = [sys.executable, "-m", "orchard.cluster.cli", "serve", "--model", str(demo_model_path),
           "--host", "127.0.0.1", "--port", str(port), "--no-ray"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", proc, timeout_s=180)
        yield base, proc
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def orchard(orchard_process):
    return orchard_process[0]


@pytest.mark.skipif(find_openblas() is None, reason="no OpenBLAS on this machine")
def test_serve_runs_with_openblas_preloaded_and_one_blas_thread(orchard_process):
    environ = dict(item.split("=", 1) for item in
                   open(f"/proc/{orchard_process[1].pid}/environ").read().split("\0") if "=" in item)
    assert "openblas" in environ["LD_PRELOAD"]
    assert environ["OPENBLAS_NUM_THREADS"] == os.environ.get("OPENBLAS_NUM_THREADS", "1")


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


def bench_without_tokenizer(base: str, out, *extra: str) -> dict:
    assert main(["bench", "serve", "--base-url", base, "--num-prompts", "6", "--output-len", "2",
                 "--max-concurrency", "3", "--no-progress", "--result-file", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_prompts_have_the_requested_token_counts_without_a_tokenizer_flag(orchard, tmp_path):
    doc = bench_without_tokenizer(orchard, tmp_path / "random.json", "--input-len", "37")
    assert doc["dataset"]["lengths_exact"] is True
    assert doc["dataset"]["prompt_lengths"] == "tokens of the served model (its /tokenize)"
    reqs = doc["runs"][0]["requests"]
    assert len(reqs) == 6
    # prompt_tokens is the server's own count of what it was sent (usage), not the bench's
    assert [(r["input_tokens"], r["prompt_tokens"]) for r in reqs] == [(37, 37)] * 6


def test_prefix_and_suffix_lengths_add_up_in_the_served_models_tokens(orchard, tmp_path):
    doc = bench_without_tokenizer(orchard, tmp_path / "prefix.json", "--dataset", "prefix-repetition",
                                  "--prefix-len", "40", "--input-len", "9", "--num-prefixes", "2")
    assert doc["dataset"]["lengths_exact"] is True
    assert {r["prompt_tokens"] for r in doc["runs"][0]["requests"]} == {49}


def test_served_word_table_agrees_with_the_servers_tokenize(orchard):
    import asyncio
    import random

    from orchard.cluster.bench.loadgen.client import EndpointConfig
    from orchard.cluster.bench.loadgen.served_tokenizer import served_word_table

    model = httpx.get(orchard + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def table():
        async with httpx.AsyncClient(timeout=30) as http:
            return await served_word_table(http, EndpointConfig(orchard, model))

    words = asyncio.run(table())
    rng = random.Random(5)
    for n in (1, 3, 128, 333):
        text = words.text(n, rng)
        reply = httpx.post(orchard + "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                           timeout=30).json()
        assert reply["count"] == n, text
