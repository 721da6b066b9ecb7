"""The engine against mlx-lm itself: greedy tokens must match `mlx_lm.generate_step` exactly."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.types import SamplingParams

MAX_TOKENS = 12


def _prompts(vocab: int, lengths: list[int], offset: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of the given lengths, avoiding special ids at the top."""
    return [[(7 * i + 13 * j + offset) % (vocab - 8) + 3 for j in range(n)] for i, n in enumerate(lengths)]


def _reference(model_dir, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    model, _ = load(str(model_dir))
    outs = []
    for prompt in prompts:
        tokens = [int(t) for (t, _) in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
        outs.append(tokens)
    return outs


def _finish(engine: LLMEngine, prompts, params, prefix: str = "r") -> list:
    """Run `prompts` to completion; their final outputs in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"{prefix}{i}"] for i in range(len(prompts))]


def _run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in _finish(engine, prompts, params)]


def _assert_no_leak(engine: LLMEngine) -> None:
    stats = engine.kv.stats()
    assert stats.blocks_used == 0, f"{stats.blocks_used} blocks still in use"
    assert not engine.scheduler.running and not engine.scheduler.waiting


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = [5, 17, 33, 8, 64, 1, 40, 23]


@pytest.fixture(scope="module")
def references(model_dirs):
    cache = {}

    def get(name, prompts):
        key = (name, tuple(map(tuple, prompts)))
        if key not in cache:
            cache[key] = _reference(model_dirs[name], prompts)
        return cache[key]

    return get


@pytest.mark.parametrize("name", ["demo", "qwen3", "mistral"])
def test_greedy_batch_of_mixed_lengths_matches_mlx_lm(name, model_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(model_dirs[name]), num_blocks=64, block_size=16))
    prompts = _prompts(engine.model.vocab_size, LENGTHS)
    assert _run(engine, prompts, GREEDY) == references(name, prompts)
    _assert_no_leak(engine)


@pytest.mark.parametrize("name", ["demo", "qwen3"])
def test_shared_prefix_is_served_from_cache_with_identical_tokens(name, model_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(model_dirs[name]), num_blocks=64, block_size=8))
    vocab = engine.model.vocab_size
    system = _prompts(vocab, [40], offset=5)[0]
    prompts = [system + tail for tail in _prompts(vocab, [3, 9, 16, 1])]
    expected = references(name, prompts)
    assert _run(engine, prompts[:1], GREEDY) == expected[:1]
    hits_before = engine.kv.stats().prefix_hit_tokens
    finals = _finish(engine, prompts[1:], GREEDY, prefix="s")
    assert [out.outputs[0].token_ids for out in finals] == expected[1:]
    assert all(out.num_cached_tokens == 40 for out in finals)
    assert engine.kv.stats().prefix_hit_tokens - hits_before == 3 * 40
    _assert_no_leak(engine)


def test_a_burst_sharing_a_prefix_computes_it_once_with_identical_tokens(model_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, block_size=8))
    vocab = engine.model.vocab_size
    system = _prompts(vocab, [40], offset=5)[0]
    prompts = [system + tail for tail in _prompts(vocab, [3, 9, 16, 1])]
    finals = _finish(engine, prompts, GREEDY, prefix="b")  # all four arrive before the first step
    assert [out.outputs[0].token_ids for out in finals] == references("demo", prompts)
    assert [out.num_cached_tokens for out in finals] == [0, 40, 40, 40]
    _assert_no_leak(engine)


def test_prefill_chunks_smaller_than_prompts_give_identical_tokens(model_dirs, references):
    engine = LLMEngine(
        EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, block_size=16, max_num_batched_tokens=7)
    )
    prompts = _prompts(engine.model.vocab_size, LENGTHS)
    assert _run(engine, prompts, GREEDY) == references("demo", prompts)
    _assert_no_leak(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_with_identical_tokens(mode, model_dirs, references, tmp_path):
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dirs["demo"]),
            num_blocks=14,
            block_size=4,
            preemption=mode,
            cold_tier_dir=str(tmp_path / "cold") if mode == "swap" else None,
            cold_tier_gb=0.05,
        )
    )
    prompts = _prompts(engine.model.vocab_size, [9, 13, 6, 11])
    assert _run(engine, prompts, GREEDY) == references("demo", prompts)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.scheduler.num_swaps > 0) == (mode == "swap")
    _assert_no_leak(engine)


def test_seeded_sampling_repeats_and_n4_shares_the_prompt_blocks(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, block_size=4))
    prompt = _prompts(engine.model.vocab_size, [18])[0]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=42, ignore_eos=True)
    first, second = _run(engine, [prompt], params), _run(engine, [prompt], params)
    assert first == second

    engine.add_request("fan", prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=42, n=4, ignore_eos=True))
    engine.step()  # prefill and the first sample: the four continuations now exist
    tables = [engine.kv.block_table(f"fan/{i}") for i in range(4)]
    full_prompt_blocks = len(prompt) // 4
    assert all(t[:full_prompt_blocks] == tables[0][:full_prompt_blocks] for t in tables)
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            final = out if out.finished else final
    continuations = [tuple(o.token_ids) for o in final.outputs]
    assert len(set(continuations)) == 4
    _assert_no_leak(engine)


def test_stop_string_cuts_text_and_streamed_deltas_concatenate(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64))
    prompt = engine.tokenizer.encode("the orchard")
    engine.add_request("full", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    full = None
    while engine.has_unfinished:
        for out in engine.step():
            full = out
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    engine.add_request("cut", prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True))
    deltas = []
    while engine.has_unfinished:
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            last = out
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert last.outputs[0].text == text[: text.find(stop)]
    assert "".join(deltas) == last.outputs[0].text
    _assert_no_leak(engine)


def test_abort_frees_blocks_at_once(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64))
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    assert engine.kv.stats().blocks_used > 0
    assert engine.abort("a")
    assert engine.kv.stats().blocks_used == 0
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_steps_leave_no_threads_behind(model_dirs):
    """A serving process steps its engine for days: no step may leave a native thread behind
    (a second MLX stream in the reference attention once left one per layer and step)."""
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, block_size=8))
    engine.add_request("a", list(range(3, 60)), SamplingParams(temperature=0.8, seed=1, max_tokens=30, n=2))
    for _ in range(3):
        engine.step()
    before = len(os.listdir("/proc/self/task"))
    while engine.has_unfinished:
        engine.step()
    assert len(os.listdir("/proc/self/task")) <= before
