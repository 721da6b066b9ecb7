"""The asyncio front: streaming, aborts on a vanished consumer, failures surfaced, clean exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from orchard.node.async_engine import AsyncEngine, EngineStepFailed
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.errors import PromptTooLong
from orchard.node.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(demo_model_dir):
    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(demo_model_dir), num_blocks=64)))
    yield eng
    eng.shutdown()


async def _collect(eng: AsyncEngine, request_id: str, prompt, params=GREEDY):
    return [out async for out in eng.generate(request_id, prompt, params)]


def test_stream_deltas_add_up_to_the_offline_result(engine, demo_model_dir):
    outs = asyncio.run(_collect(engine, "a", [5, 6, 7, 8]))
    streamed = [t for o in outs for t in o.outputs[0].token_ids_delta]
    offline = LLMEngine(EngineConfig(model=str(demo_model_dir), num_blocks=64))
    offline.add_request("a", [5, 6, 7, 8], GREEDY)
    while offline.has_unfinished:
        final = offline.step()
    assert outs[-1].finished and streamed == final[0].outputs[0].token_ids


def test_refused_request_raises_its_named_error(engine):
    with pytest.raises(PromptTooLong):
        asyncio.run(_collect(engine, "long", list(range(3, 3 + engine.max_model_len))))


def test_a_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    async def take_two():
        agen = engine.generate("b", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats()["kv"]["blocks_used"] == 0 and engine.stats()["aborted_requests"] == 1:
                return True
        return False

    assert asyncio.run(take_two())


def test_a_failing_step_fails_its_streams_and_the_engine_keeps_serving(engine, monkeypatch):
    runner = engine.engine.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky(step, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real_forward(step, **kwargs)

    monkeypatch.setattr(runner, "forward", flaky)
    with pytest.raises(EngineStepFailed, match="device lost"):
        asyncio.run(_collect(engine, "c", [5, 6, 7]))
    outs = asyncio.run(_collect(engine, "d", [5, 6, 7]))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    assert engine.engine.kv.stats().blocks_used == 0


def test_process_exits_cleanly_without_an_explicit_shutdown(demo_model_dir):
    script = textwrap.dedent(
        f"""
        import asyncio
        from orchard.node.async_engine import AsyncEngine
        from orchard.node.engine import EngineConfig
        from orchard.node.types import SamplingParams
        eng = AsyncEngine.from_config(EngineConfig(model={str(demo_model_dir)!r}, num_blocks=32))
        async def main():
            async for _ in eng.generate("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4)):
                pass
        asyncio.run(main())
        print("ok")
        """
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.stdout.strip() == "ok"


def test_calls_from_a_thread_run_in_order_settle_on_the_engine_thread_and_publish_with_the_next_loop_call(engine):
    import threading

    seen, settled, published = [], [], []
    engine.add_kv_listener(lambda events: published.append(len(events)))
    engine_thread = []

    def call(i):
        def fn(_engine):
            engine_thread.append(threading.current_thread())
            if i == 2:
                raise ValueError("refused")
            seen.append(i)
            return i
        return fn

    for i in range(4):
        engine.call_from_thread(call(i), lambda result, exc: settled.append((result, type(exc).__name__ if exc else None)))
    asyncio.run(engine.run_on_engine(lambda _e: None))  # queued after them: they have all run
    assert seen == [0, 1, 3]
    assert settled == [(0, None), (1, None), (None, "ValueError"), (3, None)]
    assert len(set(engine_thread)) == 1 and engine_thread[0] is not threading.current_thread()
    assert len(published) == 1  # the loop call published; the four thread calls did not


def test_a_call_made_while_the_engine_idles_runs_on_the_callers_thread_and_publishes_there(engine):
    here = threading.current_thread()
    published, ran = [], []
    engine.add_kv_listener(lambda events: published.append(threading.current_thread()))
    for _ in range(400):  # until the engine thread waits for commands (it warms up first)
        engine.call_here_if_idle(lambda _e: None, lambda _result, _exc: ran.append(threading.current_thread()), publish=True)
        if ran and ran[-1] is here:  # run here: nothing was queued, so every earlier call had run
            break
        time.sleep(0.005)
    assert ran[-1] is here and published[-1] is here and engine._thread.is_alive()


def test_a_loop_call_that_may_run_here_runs_on_the_loops_thread_while_idle_and_raises_what_it_raised(engine):
    here = threading.current_thread()

    async def calls():
        for _ in range(400):  # until the engine thread waits for commands (it warms up first)
            if await engine.run_on_engine(lambda _e: threading.current_thread(), here_if_idle=True) is here:
                break
            await asyncio.sleep(0.005)
        ran = await engine.run_on_engine(lambda _e: threading.current_thread(), here_if_idle=True)
        with pytest.raises(ValueError, match="refused"):
            await engine.run_on_engine(lambda _e: (_ for _ in ()).throw(ValueError("refused")), here_if_idle=True)
        return ran

    assert asyncio.run(calls()) is here and engine._thread.is_alive()


def test_calls_made_here_while_idle_never_overtake_calls_queued_before_them(engine):
    order, done = [], threading.Event()
    for n in range(200):
        engine.call_from_thread(lambda _e, n=n: order.append(("queued", n)), lambda *_: None)
        engine.call_here_if_idle(lambda _e, n=n: order.append(("here", n)), lambda *_: None)
    engine.call_from_thread(lambda _e: done.set(), lambda *_: None)
    assert done.wait(10)
    assert order == [(kind, n) for n in range(200) for kind in ("queued", "here")]


def test_a_call_made_while_the_engine_steps_runs_on_the_engine_thread_between_steps(engine):
    async def call_while_stepping():
        stream = engine.generate("busy", list(range(10, 40)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        await stream.__anext__()  # stepping now
        settled = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        engine.call_here_if_idle(lambda e: (threading.current_thread(), e.has_unfinished),
                                 lambda result, exc: loop.call_soon_threadsafe(settled.set_result, result))
        result = await settled
        await stream.aclose()
        return result

    thread, stepping = asyncio.run(call_while_stepping())
    assert thread is engine._thread and stepping


def test_a_loop_call_that_does_not_publish_leaves_its_events_to_the_next_that_does(engine):
    asyncio.run(_collect(engine, "cached", list(range(10, 10 + 16 * 8))))  # blocks cached
    asyncio.run(engine.run_on_engine(lambda _e: None))  # after the last step's events were handed over
    published = []
    engine.add_kv_listener(lambda events: published.append([type(e).__name__ for e in events]))

    def evict(e):  # a pull's reservation in a full pool: cached blocks evicted to make room
        landing = e.kv.reserve_landing(e.kv.root, [bytes([n]) * 16 for n in range(64)])
        landing.release()

    asyncio.run(engine.run_on_engine(evict, publish=False))
    assert published == []
    asyncio.run(engine.run_on_engine(lambda _e: None))
    assert len(published) == 1 and "BlockRemoved" in published[0]


class RecordingSink:
    """An OutputSink noting what it was handed, and on which thread."""

    def __init__(self):
        self.calls, self.threads, self.done = [], set(), threading.Event()

    def _note(self, *call):
        self.threads.add(threading.current_thread().name)
        self.calls.append(call)

    def accepted(self, request_id):
        self._note("accepted", request_id)

    def refused(self, request_id, error):
        self._note("refused", request_id, type(error).__name__)

    def outputs(self, outputs):
        self._note("outputs", [(o.request_id, o.outputs[0].token_ids_delta, o.finished) for o in outputs])
        if sum(finished for c in self.calls if c[0] == "outputs" for _, _, finished in c[1]) == 2:
            self.done.set()

    def failed(self, request_id, error):
        self._note("failed", request_id)


def test_a_sinks_requests_get_each_step_in_one_call_on_the_engine_thread_with_the_offline_tokens(engine, demo_model_dir):
    sink, params = RecordingSink(), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.start("long", list(range(3, 3 + engine.max_model_len)), params, sink)  # refused: too long
    engine.start("a", [5, 6, 7, 8], params, sink)  # long enough that "b" joins its steps
    engine.start("b", [9, 10, 11], params, sink)
    assert sink.done.wait(60)
    assert sink.threads == {"orchard-engine"}  # no event loop between the step and the sink
    assert sink.calls[:3] == [("refused", "long", "PromptTooLong"), ("accepted", "a"), ("accepted", "b")]
    steps = [c[1] for c in sink.calls if c[0] == "outputs"]
    assert all(len({rid for rid, _, _ in step}) == len(step) for step in steps)  # a request at most once a step
    assert any(len(step) == 2 for step in steps)  # both requests' outputs of a step in one call
    streamed = {rid: [t for step in steps for r, delta, _ in step if r == rid for t in delta] for rid in ("a", "b")}
    offline = LLMEngine(EngineConfig(model=str(demo_model_dir), num_blocks=64))
    offline.add_request("a", [5, 6, 7, 8], params)
    offline.add_request("b", [9, 10, 11], params)
    final = {}
    while offline.has_unfinished:
        final.update({o.request_id: o.outputs[0].token_ids for o in offline.step() if o.finished})
    assert streamed == final


class BrokenSink(RecordingSink):
    """A sink whose `outputs` raises, as one whose event loop has closed does."""

    def outputs(self, outputs):
        raise RuntimeError("Event loop is closed")


@pytest.mark.timeout(60)  # an engine thread that died with the sink would leave "after" waiting forever
def test_a_sink_that_raises_loses_its_outputs_and_the_engine_serves_on(engine):
    engine.start("doomed", [5, 6, 7], GREEDY, BrokenSink())
    outs = asyncio.run(_collect(engine, "after", [5, 6, 7, 8]))
    assert outs[-1].finished and len([t for o in outs for t in o.outputs[0].token_ids_delta]) == GREEDY.max_tokens
    assert engine._thread.is_alive()
