"""The whole `bench serve` pipeline against a scripted server (no network)."""

import asyncio
import json

import httpx
from rich.console import Console

from orchard.cluster.bench.loadgen.benchmark import resolve_model, run_bench_async
from orchard.cluster.bench.loadgen.client import EndpointConfig
from orchard.cluster.bench.loadgen.config import ServeBenchConfig
from orchard.cluster.bench.loadgen.datasets import DatasetConfig
from orchard.cluster.bench.loadgen.prompts import LengthRange
from orchard.cluster.bench.loadgen.report import print_summary
from orchard.cluster.bench.loadgen.runner import LoadConfig


def scripted_server(models=("served-model",), tokens_per_reply=3):
    seen = {"models": [], "posts": 0}

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in models]})
        if request.url.path == "/tokenize":
            return httpx.Response(404)  # as mlx_lm.server
        seen["posts"] += 1
        seen["models"].append(json.loads(request.content).get("model"))
        chunks = [{"choices": [{"text": f"t{i}"}]} for i in range(tokens_per_reply)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens_per_reply}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    return httpx.MockTransport(handler), seen


def config(**load):
    return ServeBenchConfig(EndpointConfig("http://bench.test"), DatasetConfig(input_len=LengthRange(4)),
                            LoadConfig(**load), progress=True)


def test_model_is_taken_from_v1_models_when_not_given():
    transport, seen = scripted_server()
    doc = asyncio.run(run_bench_async(config(num_prompts=3), Console(quiet=True), transport))
    assert doc["target"]["model"] == "served-model"
    assert seen["models"] == ["served-model"] * 3


def test_model_is_left_out_when_the_server_lists_none():
    transport, _ = scripted_server(models=())

    async def go():
        async with httpx.AsyncClient(transport=transport) as http:
            return await resolve_model(http, EndpointConfig("http://bench.test"))

    assert asyncio.run(go()).model is None


def test_sweep_runs_the_same_workload_once_per_level():
    transport, seen = scripted_server()
    cfg = ServeBenchConfig(EndpointConfig("http://bench.test", "m"), DatasetConfig(), LoadConfig(num_prompts=5),
                           sweep_concurrency=(1, 2, 4), progress=False)
    doc = asyncio.run(run_bench_async(cfg, Console(quiet=True), transport))
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2, 4]
    assert [r["summary"]["completed"] for r in doc["runs"]] == [5, 5, 5] and seen["posts"] == 15
    assert all(r["summary"]["total_output_tokens"] == 15 for r in doc["runs"])


def test_duration_run_reports_what_it_sent_and_prints_a_summary():
    transport, seen = scripted_server()
    doc = asyncio.run(run_bench_async(config(num_prompts=None, duration_s=0.3, request_rate=40.0),
                                      Console(quiet=True), transport))
    s = doc["runs"][0]["summary"]
    assert s["completed"] == seen["posts"] == len(doc["runs"][0]["requests"]) > 0
    assert doc["load"]["duration_s"] == 0.3 and doc["load"]["request_rate"] == 40.0
    console = Console(record=True, width=120)
    print_summary(doc, console)
    text = console.export_text()
    assert f"completed {s['completed']}" in " ".join(text.replace("│", " ").split())
    assert "approximate: one word per token (the server has no /tokenize" in text  # word prompts say why
