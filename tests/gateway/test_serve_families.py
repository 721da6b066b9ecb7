"""`orchard serve` on checkpoints of other families, queried with the official openai client.

Served models load in one thread and step in the engine's own (in a Ray actor with Ray),
which is where arrays computed at construction (Llama 3's rope frequencies) used to break
every request. Greedy completions must be mlx-lm's own greedy tokens, on a 4-bit quantized
checkpoint too, and on families whose layers keep sliding windows and attention sinks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from orchard.node.model.demo import write_demo_model
from tests.node.tiny_models import write_quantized_model, write_tiny_model

ORCHARD = Path(sys.executable).with_name("orchard")
MAX_TOKENS = 12
PROMPT = [5, 17, 230, 41, 9, 300, 77, 12, 1200, 64, 3, 88, 19]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    demo = write_demo_model(root / "demo")
    # gemma3 and gpt_oss window some layers (5 tokens) and gpt_oss has attention sinks: the prompt crosses the windows.
    # qwen3_next: Gated DeltaNet layers keep a recurrent state (the state pool) between attention layers.
    names = ("llama3", "qwen3_moe", "qwen3", "gemma3", "gpt_oss", "qwen3_next")
    folders = {name: write_tiny_model(root / name, name, demo) for name in names}
    # What Mac users mostly download: a 4-bit mlx-community-style checkpoint, head tied to a quantized embedding.
    folders["qwen3-4bit"] = write_quantized_model(root / "qwen3-4bit", folders.pop("qwen3"), bits=4, group_size=64)
    return folders


def mlx_lm_greedy(folder: Path, prompt: list[int] = PROMPT) -> tuple[list[int], str]:
    model, tokenizer = load(str(folder))
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]
    return tokens, tokenizer.decode(tokens)


def mlx_lm_greedy_text(folder: Path) -> str:
    return mlx_lm_greedy(folder)[1]


@contextlib.contextmanager
def served(folder: Path, log: Path, *flags: str):
    """A real `orchard serve` process on a free port; yields (base url, model name)."""
    command = [str(ORCHARD), "serve", "--model", str(folder), "--port", "0", "--max-model-len", "256",
               "--kv-memory", "0.02", "--grace", "10", *flags]
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        line = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://\S+)/v1", line)
        assert match, (line, log.read_text()[-3000:])
        yield match.group(2), match.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def greedy_completion(url: str, model: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def assert_is_mlx_lm_greedy(completion, folder: Path) -> None:
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert completion.choices[0].text == mlx_lm_greedy_text(folder)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "qwen3-4bit", "gemma3", "gpt_oss", "qwen3_next"])
def test_serve_without_ray_answers_with_mlx_lm_greedy_tokens(family, checkpoints, tmp_path):
    with served(checkpoints[family], tmp_path / "serve.log", "--no-ray") as (url, model):
        completion = greedy_completion(url, model)
    assert_is_mlx_lm_greedy(completion, checkpoints[family])


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "qwen3_next"])
def test_serve_with_ray_answers_with_mlx_lm_greedy_tokens(family, checkpoints, tmp_path):
    with served(checkpoints[family], tmp_path / "serve.log") as (url, model):
        completion = greedy_completion(url, model)
    assert_is_mlx_lm_greedy(completion, checkpoints[family])


@pytest.mark.timeout(240)
def test_serve_with_compiled_decode_answers_with_mlx_lm_greedy_tokens(checkpoints, tmp_path):
    """Decode graphs are traced and replayed in the engine's own thread, on Llama 3's rope, with steps
    overlapped: the flags a GPU defaults to, asked for on this CPU."""
    with served(checkpoints["llama3"], tmp_path / "serve.log", "--no-ray", "--compiled-decode", "on",
                "--async-scheduling") as (url, model):
        completion = greedy_completion(url, model)
    assert_is_mlx_lm_greedy(completion, checkpoints["llama3"])


@pytest.mark.timeout(240)
def test_a_hybrid_models_next_turn_is_served_from_its_state_snapshot(checkpoints, tmp_path):
    """Turn 2 resends turn 1 and its answer: the server reports the cached prompt tokens (up to
    the last block boundary turn 1 computed, 16 of 24) and still answers with mlx-lm's tokens."""
    folder = checkpoints["qwen3_next"]
    answer, _ = mlx_lm_greedy(folder)
    turn2 = PROMPT + answer + [60, 61, 62]
    with served(folder, tmp_path / "serve.log", "--no-ray") as (url, model):
        first = greedy_completion(url, model)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        second = client.completions.create(model=model, prompt=turn2, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 16
    assert second.choices[0].text == mlx_lm_greedy(folder, turn2)[1]
