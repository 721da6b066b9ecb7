"""Architectures beyond the demo's, token-exact against mlx-lm over the paged pool.

Each family is a tiny random checkpoint built with mlx-lm's own classes (`tiny_models`).
The engine's greedy tokens must equal mlx-lm's own `generate_step` and its top-5
log-probs agree to 1e-5 in float32, through chunked prefill in a packed batch, a prefix
served from the cache, and preemption.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.types import SamplingParams
from tests.node.tiny_models import write_quantized_model, write_tiny_model

FAMILIES = ["llama3", "qwen2", "qwen3_moe", "qwen2_moe", "gemma", "phi3", "olmo2", "glm4", "starcoder2", "hunyuan",
            "granite", "cohere", "mixtral", "smollm3", "internlm2", "minimax", "mistral3", "exaone",
            # sliding windows per layer (gpt-oss with attention sinks too), windows shorter than the prompts
            "gemma3_text", "gemma3", "gpt_oss", "llama_swa", "olmo3",
            # Ministral 3 (windows too) scales queries by position; Gemma 2 soft-caps scores and logits
            "ministral3", "mistral3_ministral3", "gemma2",
            # keys and values of different head dims
            "deepseek_v2", "deepseek_v2_q_lora"]
#: Quantized checkpoints as mlx-community publishes them, (family, bits, group size): qwen3 ties its
#: head to a quantized embedding, mistral quantizes a separate lm_head, qwen3_moe its experts too.
QUANTIZED = {"qwen3-4bit-g64": ("qwen3", 4, 64), "mistral-8bit-g32": ("mistral", 8, 32),
             "qwen3_moe-4bit-g32": ("qwen3_moe", 4, 32), "gemma3_text-4bit-g32": ("gemma3_text", 4, 32),
             "gpt_oss-8bit-g32": ("gpt_oss", 8, 32), "gemma2-4bit-g32": ("gemma2", 4, 32),
             "deepseek_v2-4bit-g32": ("deepseek_v2", 4, 32)}
MAX_TOKENS = 8
TOP = 5
LOGPROB_ATOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)


def prompts(vocab: int, lengths: list[int], offset: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of the given lengths, away from the special ids."""
    return [[(7 * i + 13 * j + offset) % (vocab - 8) + 3 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=FAMILIES + list(QUANTIZED))
def family(request, tmp_path_factory, demo_model_dir):
    name, bits, group_size = QUANTIZED.get(request.param, (request.param, None, None))
    folder = write_tiny_model(tmp_path_factory.mktemp(name), name, demo_model_dir)
    if bits is not None:
        folder = write_quantized_model(tmp_path_factory.mktemp(request.param) / "model", folder, bits, group_size)
    reference_model, _ = load(str(folder))
    return folder, reference_model


def reference(model, prompt: list[int]) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """mlx-lm's greedy tokens and, per token, its top-5 (id, log-prob) best first."""
    tokens, tops = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        row = np.array(logprobs)
        best = np.argsort(-row, kind="stable")[:TOP]
        tokens.append(int(token))
        tops.append([(int(t), float(row[t])) for t in best])
    return tokens, tops


def run(engine: LLMEngine, batch: list[list[int]], prefix: str = "r") -> list[tuple]:
    """All of `batch` added before the first step, run to completion.

    Per prompt: (final output, every generated token's top log-probs, collected from the deltas).
    """
    for i, prompt in enumerate(batch):
        engine.add_request(f"{prefix}{i}", prompt, GREEDY)
    finals, tops = {}, {f"{prefix}{i}": [] for i in range(len(batch))}
    while engine.has_unfinished:
        for out in engine.step():
            tops[out.request_id].extend(step.top for step in out.outputs[0].logprobs_delta)
            if out.finished:
                finals[out.request_id] = out
    return [(finals[f"{prefix}{i}"], tops[f"{prefix}{i}"]) for i in range(len(batch))]


def assert_matches_mlx_lm(model, batch, results) -> None:
    for prompt, (final, engine_tops) in zip(batch, results):
        tokens, tops = reference(model, prompt)
        assert final.outputs[0].token_ids == tokens
        assert len(engine_tops) == len(tops)
        for step, (got, want) in enumerate(zip(engine_tops, tops)):
            assert [t for t, _ in got] == [t for t, _ in want], f"top-{TOP} ids differ at token {step}"
            np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=LOGPROB_ATOL, rtol=0)


def test_chunked_prefill_in_a_packed_batch_matches_mlx_lm(family):
    folder, model = family
    # Chunks of 7 tokens over blocks of 4: chunk and block edges fall at different places.
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, max_num_batched_tokens=7))
    batch = prompts(engine.model.vocab_size, [5, 17, 1, 11])
    assert_matches_mlx_lm(model, batch, run(engine, batch))


def test_a_prefix_served_from_the_cache_matches_mlx_lm(family):
    folder, model = family
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    vocab = engine.model.vocab_size
    system = prompts(vocab, [12], offset=5)[0]
    batch = [system + tail for tail in prompts(vocab, [3, 6])]
    first = run(engine, batch[:1], prefix="first")
    second = run(engine, batch[1:], prefix="second")
    assert second[0][0].num_cached_tokens == len(system)
    assert_matches_mlx_lm(model, batch, first + second)


def test_preempted_sequences_resume_matching_mlx_lm(family):
    folder, model = family
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=10, block_size=4, preemption="recompute"))
    batch = prompts(engine.model.vocab_size, [9, 13, 6])
    results = run(engine, batch)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_mlx_lm(model, batch, results)
