"""Decode steps replayed from compiled graphs give what the eager forward gives, write the pool
in place, and trace one graph per bucket.

The CPU runs attention on the reference backend, where compiled decode is off by default
(`EngineConfig.compiled_decode=None`); these tests turn it on, so the graphs hold the
reference's on-device decode instead of a GPU kernel. The kernels' own CUDA path is checked on
an accelerator (`-m cuda` below).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from orchard.node.engine import EngineConfig, LLMEngine, build_step_input
from orchard.node.model.compiled_decode import BATCH_BUCKETS, batch_bucket, buckets_up_to, width_bucket
from orchard.node.model.runner import ModelRunner
from orchard.node.scheduler import ScheduledChunk
from orchard.node.types import SamplingParams
from tests.node.test_async_scheduling import MIXED_PARAMS, _run_all
from tests.node.test_engine import _assert_no_leak, _prompts
from tests.node.tiny_models import write_tiny_model


def _engine(model_dirs, compiled: bool, **kw) -> LLMEngine:
    config = dict(model=str(model_dirs["demo"]), num_blocks=256, block_size=4, max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(**{**config, **kw}, compiled_decode=compiled))


def test_buckets_hold_their_rows_and_grow_slowly():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 80, 81)] == [1, 2, 4, 8, 16, 32, 48, 64, 80, 80, 96]
    assert all(batch_bucket(n) >= n for n in range(1, 300))
    assert [width_bucket(n) for n in (1, 2, 3, 16, 17, 64, 65, 1025)] == [16, 16, 16, 16, 64, 64, 256, 4096]
    assert buckets_up_to(5, 17) == [(b, w) for b in (1, 2, 4, 8) for w in (16, 64)]
    assert buckets_up_to(70, 3) == [(b, 16) for b in (*BATCH_BUCKETS, 80)]
    assert BATCH_BUCKETS == tuple(sorted(BATCH_BUCKETS))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_compiled_decode_is_off_on_the_host_planned_backends_by_default(model_dirs, monkeypatch, backend):
    if backend not in kernels.available_backends():
        pytest.skip(f"the {backend} backend is not available here")
    monkeypatch.setenv(kernels.ENV_VAR, backend)
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64))
    assert engine.runner.attention_backend == backend
    assert engine.runner.compiled_decode is None


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy-pool", "preempting-pool"])
def test_compiled_decode_gives_the_eager_engines_tokens_and_logprobs(model_dirs, num_blocks):
    """Greedy, seeded sampling, n=3 forks, penalties and logprobs, overlapped steps, and preemption."""
    results = []
    for compiled in (False, True):
        engine = _engine(model_dirs, compiled, num_blocks=num_blocks)
        prompts = _prompts(engine.model.vocab_size, [9, 21, 6, 13, 17, 5])
        results.append((_run_all(engine, prompts, MIXED_PARAMS), engine.scheduler.num_preemptions))
        _assert_no_leak(engine)
        if compiled:
            assert engine.runner.compiled_decode.traces > 0
    (eager, eager_preempted), (compiled, compiled_preempted) = results
    assert compiled == eager
    if num_blocks == 20:
        assert eager_preempted > 0 and compiled_preempted > 0


def test_compiled_decode_over_values_narrower_than_keys_gives_the_eager_engines_tokens(demo_model_dir, tmp_path):
    """DeepSeek-V2 attends on the reference wherever it runs; a compiled graph holds its decode too."""
    folder = write_tiny_model(tmp_path / "deepseek_v2", "deepseek_v2", demo_model_dir)
    results = []
    for compiled in (False, True):
        engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, compiled_decode=compiled))
        results.append(_run_all(engine, _prompts(engine.model.vocab_size, [9, 5, 13, 7, 11, 6]), MIXED_PARAMS))
        if compiled:
            assert engine.runner.compiled_decode.traces > 0
    assert results[0] == results[1]


def _decode_step(engine: LLMEngine, rows: int, prompt: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{i}", [3 + (i * 5 + j) % 200 for j in range(prompt)], params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.config.async_scheduling = False
    engine.step()  # settles the step in flight: every running sequence's next input is on the host
    chunks = [ScheduledChunk(s, 1) for s in engine.scheduler.running]
    for c in chunks:
        engine.kv.ensure_slots(c.seq.seq_id, c.seq.num_computed + 1)
    return build_step_input(chunks, engine.kv, engine.config.block_size)


def test_a_padded_batch_gives_each_real_row_the_eager_logits(model_dirs):
    """Five rows run in the bucket of eight: the padding rows change nothing the real rows get."""
    engine = _engine(model_dirs, False)
    step = _decode_step(engine, 5)
    eager = engine.runner.forward(step)
    compiled_runner = ModelRunner(engine.model, engine.kv.pool, compiled_decode=True)
    before = [np.array(k) for k in engine.kv.pool.keys]
    compiled = compiled_runner.forward(step)
    mx.eval(compiled, engine.kv.pool.keys)
    assert compiled.shape == eager.shape == (5, engine.model.vocab_size)
    np.testing.assert_allclose(np.array(compiled), np.array(eager), rtol=1e-5, atol=1e-5)
    for layer, old in enumerate(before):  # the same K/V again, at the same slots; padding wrote block 0 only
        np.testing.assert_allclose(np.array(engine.kv.pool.keys[layer])[1:], old[1:], rtol=1e-5, atol=1e-5)


def test_a_compiled_step_writes_the_pool_in_place(model_dirs):
    """The pool's arrays go through the graph as inputs and outputs; the scatter must reuse them."""
    engine = _engine(model_dirs, True, num_blocks=20_000, block_size=16, max_num_batched_tokens=512)
    pool_bytes = engine.kv.pool.nbytes
    assert pool_bytes > 500e6
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"m{i}", [5 + i + j for j in range(20)], params)
    for _ in range(3):
        engine.step()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    while engine.has_unfinished:
        engine.step()
    assert engine.runner.compiled_decode.traces > 0
    assert mx.get_peak_memory() - active < pool_bytes / 20


def test_graphs_are_traced_once_per_bucket(model_dirs):
    engine = _engine(model_dirs, True)
    prompts = _prompts(engine.model.vocab_size, [9, 21, 6, 13, 17, 5])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 22, 14, 9, 5, 3)]
    first = _run_all(engine, prompts, params)
    traced = engine.runner.compiled_decode.traces
    # Six rows shrinking to one, contexts growing from 2 to 13 blocks: at most 4 batch x 4 width buckets.
    assert 2 <= traced <= 16
    again = _run_all(engine, prompts, params)
    assert engine.runner.compiled_decode.traces == traced
    assert again == first


@pytest.mark.cuda
def test_compiled_decode_on_cuda_gives_the_eager_tokens(model_dirs):
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("MLX has no CUDA device here")
    results = []
    for compiled in (False, True):
        engine = _engine(model_dirs, compiled, block_size=16, max_num_batched_tokens=64)
        assert engine.runner.attention_backend == "cuda"
        prompts = _prompts(engine.model.vocab_size, [9, 21, 6, 13, 17, 5])
        results.append(_run_all(engine, prompts, MIXED_PARAMS)["finals"])
    assert results[1] == results[0]


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_compiled_decode_keeps_each_layers_window_and_sinks(family, model_dirs, tmp_path):
    """Windowed layers (and gpt-oss's sinks) decoded from compiled graphs past several windows."""
    from tests.node.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / family, family, model_dirs["demo"])
    finals = []
    for compiled in (False, True):
        engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=128, block_size=4, max_num_batched_tokens=16,
                                        compiled_decode=compiled))
        prompts = _prompts(engine.model.vocab_size, [11, 3, 8])
        params = [SamplingParams(temperature=0.0, max_tokens=18, logprobs=2, ignore_eos=True)] * 3
        finals.append(_run_all(engine, prompts, params)["finals"])
    assert finals[1] == finals[0]


def test_warm_up_traces_every_bucket_so_serving_traces_none(model_dirs):
    engine = _engine(model_dirs, True, max_num_seqs=6, warm_up_context=40)
    assert engine.warm_up() == 4 * 1  # batches 1, 2, 4, 8; contexts up to 40 tokens fit the 16-block width
    assert engine.warm_up() == 0
    prompts = _prompts(engine.model.vocab_size, [9, 21, 6, 13, 17, 5])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (14, 12, 10, 8, 6, 4)]
    warm = _run_all(engine, prompts, params)
    assert engine.runner.compiled_decode.traces == 4
    cold = _run_all(_engine(model_dirs, True, max_num_seqs=6), prompts, params)
    assert warm == cold  # the padding rows the warm-up ran wrote nowhere a sequence reads


def test_engines_over_one_model_share_the_graphs_and_not_each_others_pools(model_dirs):
    import gc
    import weakref

    first = _engine(model_dirs, True, max_num_seqs=2, warm_up_context=8)
    traced = first.warm_up()
    second = LLMEngine(EngineConfig(num_blocks=256, block_size=4, compiled_decode=True, max_num_seqs=2,
                                    warm_up_context=8), loaded=first.model)
    assert second.runner.compiled_decode is first.runner.compiled_decode and second.warm_up() == 0 < traced
    pool = weakref.ref(first.kv.pool)
    del first
    gc.collect()
    assert pool() is None
    prompts = _prompts(second.model.vocab_size, [7, 5])
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    assert len(_run_all(second, prompts, params)) == 2
