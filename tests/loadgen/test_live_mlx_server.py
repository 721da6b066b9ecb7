"""`orchard bench serve` against a real mlx_lm.server serving the demo model."""

from __future__ import annotations

import json

import httpx
import pytest

from orchard.cluster.cli.main import main
from tests.loadgen.live_server import mlx_lm_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def server(demo_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("mlx_lm_server") / "server.log"
    with mlx_lm_server(str(demo_model_path), str(log)) as base:
        yield base


def bench(server, model, out, *extra):
    args = ["bench", "serve", "--base-url", server, "--model", str(model), "--tokenizer", str(model),
            "--no-progress", "--result-file", str(out), *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def assert_percentiles_ordered(summary):
    for key in LATENCIES:
        d = summary[key]
        assert d["count"] > 0, key
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], key


def test_random_dataset_counts_match_what_the_server_generated(server, demo_model_path, tmp_path):
    doc = bench(server, demo_model_path, tmp_path / "random.json", "--num-prompts", "4", "--input-len", "24",
                "--output-len", "6", "--max-concurrency", "2", "--save-text", "--goodput", "ttft:60000")
    run = doc["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert (s["completed"], s["failed"]) == (4, 0)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert doc["dataset"]["lengths_exact"] is True
    assert_percentiles_ordered(s)
    for r in reqs:
        assert r["token_source"] == "usage" and r["prompt_tokens"] == r["input_tokens"] == 24
        assert 1 <= r["content_chunks"] <= r["output_tokens"] <= 6
        assert len(r["itl_ms"]) == r["content_chunks"] - 1
    # Replay each prompt without streaming: the server's own count and text must agree.
    prompts = _prompts(demo_model_path, n=4, input_len=24, output_len=6)
    for r in reqs:
        body = {"model": str(demo_model_path), "prompt": prompts[r["conversation_id"]], "max_tokens": 6,
                "temperature": 0.0}
        reply = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == r["output_tokens"]
        assert reply["choices"][0]["text"] == r["text"]
    assert (tmp_path / "random_latency_cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_multi_turn_sweep_grows_context_and_plots_throughput(server, demo_model_path, tmp_path):
    doc = bench(server, demo_model_path, tmp_path / "chat.json", "--dataset", "multi-turn", "--turns", "2",
                "--num-prompts", "4", "--input-len", "12", "--output-len", "4", "--sweep-concurrency", "1,2")
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert run["summary"]["completed"] == 4
        by_turn = {(r["conversation_id"], r["turn"]): r for r in run["requests"]}
        for conv in (0, 1):
            first, second = by_turn[(conv, 0)], by_turn[(conv, 1)]
            # the second prompt holds the first exchange and a new 12-token message
            assert second["prompt_tokens"] >= first["prompt_tokens"] + first["output_tokens"] + 12
    for name in ("chat_latency_cdf.png", "chat_throughput_vs_concurrency.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def _prompts(model, n, input_len, output_len):
    from orchard.cluster.bench.loadgen.datasets import DatasetConfig, conversations
    from orchard.cluster.bench.loadgen.prompts import LengthRange, TokenizerPrompts

    cfg = DatasetConfig("random", LengthRange(input_len), LengthRange(output_len))
    return [c.turns[0].text for c in conversations(cfg, TokenizerPrompts(str(model)), n)]


def test_without_tokenize_the_tokenizer_of_the_model_the_server_names_sizes_prompts(server, demo_model_path, tmp_path):
    # mlx_lm.server has no /tokenize; its /v1/models names the --model folder, which is on this machine
    out = tmp_path / "named.json"
    assert main(["bench", "serve", "--base-url", server, "--model", str(demo_model_path), "--num-prompts", "3",
                 "--input-len", "21", "--output-len", "2", "--no-progress", "--result-file", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dataset"]["lengths_exact"] is True
    assert doc["dataset"]["prompt_lengths"] == f"tokens of {demo_model_path / 'tokenizer.json'}"
    assert [r["prompt_tokens"] for r in doc["runs"][0]["requests"]] == [21] * 3

