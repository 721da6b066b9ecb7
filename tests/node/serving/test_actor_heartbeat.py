"""The node's heartbeat comes early after a request finishes, so the router sees it idle."""

from __future__ import annotations

import asyncio
import time

from orchard.node.serving.actor import NodeActor, NodeActorConfig


class _Coordinator:
    def __init__(self):
        self.beats: list[float] = []
        self.heartbeat = self

    async def remote(self, node_id, load):
        self.beats.append(time.monotonic())
        return {}


def _actor(heartbeat_s: float) -> NodeActor:
    actor = NodeActor.__new__(NodeActor)  # the loop only: no engine, no Ray
    actor.config = NodeActorConfig(node_id="n", coordinator_name="c", namespace="ns", heartbeat_s=heartbeat_s)
    actor.node_id = "n"
    actor._coordinator = _Coordinator()
    actor._beat_soon = asyncio.Event()
    actor._load = lambda: {}
    return actor


def test_a_finished_request_brings_the_next_heartbeat_forward():
    async def scenario():
        actor = _actor(heartbeat_s=5.0)
        loop = asyncio.get_running_loop().create_task(actor._heartbeat_loop())
        await asyncio.sleep(0.2)
        assert len(actor._coordinator.beats) == 1  # the first beat; the next is 5 s away
        finished = time.monotonic()
        actor._beat_soon.set()  # what `generate` does when a request ends
        await asyncio.sleep(0.3)
        loop.cancel()
        beats = actor._coordinator.beats
        assert len(beats) == 2 and beats[1] - finished < 0.25

    asyncio.run(scenario())
