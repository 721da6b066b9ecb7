"""`orchard serve`'s vLLM-style flags and its logs, through a real `--no-ray` process and the openai client."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ORCHARD = Path(sys.executable).with_name("orchard")
TEMPLATE = "{{ 'Hi' }}"  # renders the same two letters whatever the messages say


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--no-ray", "--port", "0", "--kv-memory", "0.02", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    match = re.search(r"at (http://\S+)/v1", line)
    if not match:
        proc.kill()
        raise AssertionError(f"{line!r}\n{log.read_text()[-3000:]}")
    return proc, match.group(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url = start(["--served-model-name", "tiny", "tiny-alias", "--max-model-len", "64",
                       "--no-enable-prefix-caching", "--chat-template", TEMPLATE, "--seed", "7",
                       "--dtype", "float32", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"], log)
    try:
        yield url, log, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_served_model_name_is_listed_and_requests_use_it_or_an_alias(served):
    url, _, client = served
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias"):
        done = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
        assert done.model == name and done.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="demo", prompt="hello", max_tokens=3)


def test_max_model_len_refuses_a_longer_prompt_with_400(served):
    _, _, client = served
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=" ".join(["word"] * 200), max_tokens=3)


def test_without_prefix_caching_a_repeated_prompt_reuses_nothing(served):
    url, _, client = served
    prompt = "the same prompt, long enough to fill a few blocks of sixteen tokens " * 2
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    node = httpx.get(url + "/v1/cluster").json()["nodes"][0]
    assert node["prefix_cache_query_tokens"] > 0
    assert node["prefix_cache_hit_tokens"] == 0


def test_chat_template_flag_renders_chat_prompts(served):
    _, _, client = served
    done = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a long message " * 10}], max_tokens=2)
    assert done.usage.prompt_tokens <= 3  # the template's "Hi", not the forty-token message


def test_request_ids_are_echoed_or_made_and_every_request_is_logged(served):
    url, log, _ = served
    given = httpx.get(url + "/v1/models", headers={"x-request-id": "client-id-42"})
    made = httpx.get(url + "/health")
    assert given.headers["x-request-id"] == "client-id-42"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    time.sleep(0.2)
    text = log.read_text()
    assert re.search(r'"GET /v1/models" 200 \d+\.\d+s request_id=client-id-42', text), text[-2000:]
    assert f"request_id={made.headers['x-request-id']}" in text


def test_start_summary_and_a_stats_line_while_there_is_traffic(served):
    url, log, client = served
    text = log.read_text()
    assert re.search(r"KV pool local: \d+ blocks of 16 tokens \(\d+\.\d+ GB, \d+ tokens\)", text), text
    assert f"API {url}/v1, metrics {url}/metrics, dashboard {url}/dashboard" in text
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and "Avg generation throughput" not in log.read_text():
        client.completions.create(model="tiny", prompt="stats", max_tokens=8)
        time.sleep(0.5)
    line = next(x for x in log.read_text().splitlines() if "Avg generation throughput" in x)
    assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                     r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: "
                     r"[\d.]+%", line), line


def test_a_tokenizer_other_than_the_models_is_refused_before_loading():
    run = subprocess.run([str(ORCHARD), "serve", "--no-ray", "--tokenizer", "some/other-tokenizer"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--tokenizer 'some/other-tokenizer': a tokenizer other than the model's is not supported" in run.stderr


def test_tool_call_parser_flag_lets_a_template_without_a_call_format_take_tools(served):
    _, _, client = served  # the "Hi" template writes no call format: without the flag, tools are a 400
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=tools,
                                          max_tokens=2)
    assert done.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_an_unknown_parser_name_is_refused_before_loading(flag):
    run = subprocess.run([str(ORCHARD), "serve", "--no-ray", flag, "nope"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{flag}: unknown" in run.stderr


def test_version():
    for argv in (["--version"], ["serve", "--version"]):
        run = subprocess.run([str(ORCHARD), *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and re.fullmatch(r"orchard \S+\n", run.stdout)


def test_kv_memory_help_states_its_default():
    run = subprocess.run([str(ORCHARD), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "--kv-memory-fraction" in run.stdout and "(default 0.3)" in run.stdout


def test_sigterm_during_start_up_exits_cleanly(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--no-ray", "--port", "0", "--kv-memory", "0.02"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 60
    while "loading model" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) in (0, 143), log.read_text()[-3000:]
    assert "stopped by SIGTERM while starting" in log.read_text()
