"""Overlapped steps (`async_scheduling`) give exactly what step-by-step execution gives."""

from __future__ import annotations

import pytest

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.sampling import DeviceSample
from orchard.node.sequence import PENDING_TOKEN
from orchard.node.types import SamplingParams
from tests.node.test_engine import _assert_no_leak, _prompts

MIXED_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=11, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=9, seed=3, n=3, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=16, seed=11),  # may stop at EOS
]


def _run_all(engine: LLMEngine, prompts, params) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    streamed: dict[str, list] = {}
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append([o.token_ids_delta for o in out.outputs])
            assert all(PENDING_TOKEN not in o.token_ids for o in out.outputs)
            if out.finished:
                finals[out.request_id] = [
                    (o.token_ids, o.text, o.finish_reason, [(lp.token_id, round(lp.logprob, 5)) for lp in o.logprobs_delta])
                    for o in out.outputs
                ]
    return {"finals": finals, "streamed_tokens": {k: _joined(v) for k, v in streamed.items()}}


def _joined(deltas: list[list[list[int]]]) -> list[list[int]]:
    width = max(len(d) for d in deltas)
    return [[t for d in deltas if i < len(d) for t in d[i]] for i in range(width)]


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy-pool", "preempting-pool"])
def test_overlapped_steps_equal_step_by_step(model_dirs, num_blocks):
    """Step by step, overlapped, and overlapped with each step settled on the settle thread."""
    results = []
    for overlap, threaded in ((False, False), (True, False), (True, True)):
        engine = LLMEngine(EngineConfig(
            model=str(model_dirs["demo"]), num_blocks=num_blocks, block_size=4,
            max_num_batched_tokens=24, async_scheduling=overlap, settle_in_thread=threaded,
        ))
        assert (engine._settler is not None) == threaded
        prompts = _prompts(engine.model.vocab_size, [9, 21, 6, 13, 17, 5])
        results.append((_run_all(engine, prompts, MIXED_PARAMS), engine.scheduler.num_preemptions))
        _assert_no_leak(engine)
    (sync, sync_preempted), *overlapped = results
    for name, (run, preempted) in zip(("overlapped", "overlapped, settle thread"), overlapped):
        assert run == sync, f"{name} differs from step by step"
        if num_blocks == 20:
            assert sync_preempted > 0 and preempted > 0


def test_a_settle_thread_settles_while_the_next_step_is_queued(model_dirs, monkeypatch):
    """The previous step's settling runs on the settle thread, its tokens read there."""
    import threading

    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, async_scheduling=True, settle_in_thread=True))
    readers: list[str] = []
    real_resolve = DeviceSample.resolve
    monkeypatch.setattr(DeviceSample, "resolve", lambda self: readers.append(threading.current_thread().name) or real_resolve(self))
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    engine_thread = threading.current_thread().name
    # every step but the last is settled beside the start of the next; the last has no next
    assert readers[-1] == engine_thread and readers[:-1] and all(r.startswith("orchard-settle") for r in readers[:-1])


def test_next_step_is_launched_before_the_previous_tokens_are_read(model_dirs, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, async_scheduling=True))
    events: list[str] = []
    real_forward, real_resolve = engine.runner.forward, DeviceSample.resolve
    monkeypatch.setattr(engine.runner, "forward", lambda step, **kw: events.append("launch") or real_forward(step, **kw))
    monkeypatch.setattr(DeviceSample, "resolve", lambda self: events.append("read") or real_resolve(self))
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    # Every read of a step's tokens comes after the next step was launched, but the last.
    assert events == ["launch", "launch", "read", "launch", "read", "launch", "read", "read"]


def test_abort_while_a_step_is_in_flight_frees_everything_and_shows_no_placeholder(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, async_scheduling=True))
    engine.add_request("a", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    outs += engine.step()
    final = [o for o in outs if o.finished][0]
    assert final.outputs[0].finish_reason == "abort"
    assert PENDING_TOKEN not in final.outputs[0].token_ids
    assert engine.kv.stats().blocks_used == 0


def test_temperatures_below_1e_5_decode_greedily(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64))
    prompt = _prompts(engine.model.vocab_size, [12])[0]
    runs = []
    for temperature in (0.0, 1e-39, 9e-6):
        engine.add_request(f"t{temperature}", prompt, SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=5))
        final = None
        while engine.has_unfinished:
            for out in engine.step():
                final = out if out.finished else final
        runs.append(final.outputs[0].token_ids)
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_the_first_steps_of_a_node_do_not_set_its_rates():
    from orchard.node.rates import WARMUP_STEPS, NodeRates

    rates = NodeRates.new()
    for _ in range(WARMUP_STEPS):
        rates.observe_step(5.0, 100, 0)  # compiling kernels: far slower than steady state
    assert rates.prefill_s_per_token.value is None
    rates.observe_step(0.1, 100, 0)
    assert rates.prefill_s_per_token.value == pytest.approx(1e-3)


def test_a_step_line_separates_a_steps_fixed_cost_from_what_each_token_adds():
    from orchard.node.rates import WARMUP_STEPS, NodeRates

    rates = NodeRates.new()
    for _ in range(WARMUP_STEPS):
        rates.observe_step(5.0, 100, 0)  # left out
    rates.observe_step(0.010 + 40 * 1e-4, 40, 0)
    assert rates.prefill_line.marginal_s_per_token is None  # one size shows no line
    for tokens in (40, 512, 40, 512):
        rates.observe_step(0.010 + tokens * 1e-4, tokens, 0)
    assert rates.prefill_line.marginal_s_per_token == pytest.approx(1e-4, rel=1e-6)
    assert rates.prefill_s_per_token.value > 2e-4  # the average carries the fixed cost


def test_steps_settled_on_the_settle_thread_are_freed_on_the_engine_thread(model_dirs, monkeypatch):
    """Their MLX arrays must not be freed by the settle thread while the engine thread encodes."""
    import threading
    import weakref

    from orchard.node import engine as engine_module

    freed_on: list[str] = []
    real_launch = engine_module.LLMEngine._launch

    def launch(self, sched):
        flight = real_launch(self, sched)
        weakref.finalize(flight, lambda: freed_on.append(threading.current_thread().name))
        return flight

    monkeypatch.setattr(engine_module.LLMEngine, "_launch", launch)
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, async_scheduling=True, settle_in_thread=True))
    # The settle thread keeps each step it settled until it settles the next, then drops it: the
    # late last reference the engine must outlast (a thread pool's work item is released late too).
    real_settle, held = engine._settle, []

    def settle(flight):
        held.clear()
        held.append(flight)
        return real_settle(flight)

    engine._settle = settle
    for i in range(3):
        engine.add_request(f"r{i}", list(range(3 + i, 20 + i)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    held.clear()
    del engine
    import gc

    gc.collect()
    assert len(freed_on) >= 8 and set(freed_on) == {threading.current_thread().name}


def test_closing_an_engine_ends_its_settle_thread(model_dirs):
    """Only this engine's thread is watched: other tests' engines end theirs whenever they are collected."""
    import threading

    def settle_threads():
        return {t for t in threading.enumerate() if t.name.startswith("orchard-settle")}

    before = settle_threads()
    engine = LLMEngine(EngineConfig(model=str(model_dirs["demo"]), num_blocks=64, async_scheduling=True, settle_in_thread=True))
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    (mine,) = settle_threads() - before
    engine.close()
    assert not mine.is_alive()
