"""A node actor's KV events reach the coordinator in order, the first soon after a quiet spell, the rest batched."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvloop

from orchard.kvcache.events import BlockRemoved
from orchard.node.async_engine import AsyncEngine
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.serving.actor import KV_EVENTS_GAP_S, NodeActor, NodeActorConfig
from orchard.node.types import SamplingParams


class _Coordinator:
    def __init__(self):
        self.calls: list[tuple[float, list[int]]] = []  # (when, seqs)
        self.kv_events = self

    def remote(self, node_id, packed):
        self.calls.append((time.monotonic(), [e.seq for e in packed.unpack()]))


def _actor(loop: asyncio.AbstractEventLoop) -> NodeActor:
    actor = NodeActor.__new__(NodeActor)  # the loop only: no engine, no Ray
    actor.config = NodeActorConfig(node_id="n", coordinator_name="c", namespace="ns")
    actor.node_id = "n"
    actor._coordinator = _Coordinator()
    actor._loop = loop
    actor._events_lock = threading.Lock()
    actor._pending_events, actor._events_sent_at = [], float("-inf")
    return actor


def _steps(actor: NodeActor, steps: int, per_step: int, gap_s: float) -> None:
    """What the engine thread does: each step's events, handed over as the step ends."""
    seq = 0
    for _ in range(steps):
        actor._push_kv_events([BlockRemoved(seq + i, b"h%d" % (seq + i)) for i in range(per_step)])
        seq += per_step
        time.sleep(gap_s)


def test_a_steady_run_of_steps_goes_in_order_in_few_calls_and_the_first_soon():
    async def scenario():
        actor = _actor(asyncio.get_running_loop())
        start = time.monotonic()
        engine = threading.Thread(target=_steps, args=(actor, 100, 3, 0.002))
        engine.start()
        while engine.is_alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * KV_EVENTS_GAP_S)
        return start, time.monotonic(), actor._coordinator.calls, actor._next_seq

    start, end, calls, next_seq = asyncio.run(scenario())
    seqs = [s for _, batch in calls for s in batch]
    assert seqs == list(range(300))  # every event once, in the order the steps made them
    assert next_seq == 300
    assert calls[0][0] - start < KV_EVENTS_GAP_S  # a quiet node's first events are not held a whole gap
    assert calls[0][1][:3] == [0, 1, 2]
    assert len(calls) <= (end - start) / KV_EVENTS_GAP_S + 2  # one call per gap, not one per step (100)
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= KV_EVENTS_GAP_S * 0.9


def test_events_made_before_the_loop_runs_are_sent_by_the_caller():
    actor = _actor(None)  # not started: no loop to hand them to
    actor._push_kv_events([BlockRemoved(0, b"h0"), BlockRemoved(1, b"h1")])
    actor._push_kv_events([])
    assert [batch for _, batch in actor._coordinator.calls] == [[0, 1]]


@pytest.fixture
def engine_with_cached_blocks():
    """An engine whose pool holds cached blocks, their events already handed over."""
    engine = AsyncEngine(LLMEngine(EngineConfig(block_size=16, num_blocks=24, max_num_batched_tokens=128)))

    async def fill():
        async for _ in engine.generate("fill", list(range(10, 10 + 16 * 20)), SamplingParams(max_tokens=2)):
            pass
        await engine.run_on_engine(lambda _e: None)  # after the last step's events were handed over

    asyncio.run(fill())
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_what_an_engine_call_woke_runs_before_its_events_go(engine_with_cached_blocks, loop_kind):
    """An engine call that publishes (a pull's closing call; here one that evicts cached blocks) hands its
    events to the actor and then settles its caller. The caller, woken on the actor's loop, must run before
    the Ray call that sends those events: over Ray (uvloop) a timer due at once ran first, and a pull's caller
    waited for that call."""
    engine, order = engine_with_cached_blocks, []

    class Coordinator(_Coordinator):
        def remote(self, node_id, packed):
            order.append("events sent")

    def evict(e):
        e.kv.reserve_landing(e.kv.root, [bytes([n]) * 16 for n in range(24)]).release()

    async def scenario():
        actor = _actor(asyncio.get_running_loop())
        actor._coordinator = Coordinator()
        engine.add_kv_listener(actor._push_kv_events)
        await engine.run_on_engine(evict)
        order.append("caller resumed")
        await asyncio.sleep(2 * KV_EVENTS_GAP_S)

    runner = uvloop.run if loop_kind == "uvloop" else asyncio.run
    runner(scenario())
    assert order == ["caller resumed", "events sent"]
