"""The gateway's list of served models: fetched once, then refreshed behind requests, never before them."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray.exceptions as rex

from orchard.cluster.gateway.served_models import ServedModels, UnknownModel

SPEC = {"block_size": 16, "fingerprint": "f" * 16, "max_model_len": 512, "vocab_size": 100, "model_path": "/nowhere"}


class Coordinator:
    """`model_specs` as a fake coordinator answers it: after `delay` seconds, or failing."""

    def __init__(self, models=("demo",), delay: float = 0.0):
        self.models, self.delay, self.fail, self.calls = list(models), delay, False, 0

    async def __call__(self, patient: bool) -> dict:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise rex.RaySystemError("coordinator gone")
        return {name: dict(SPEC) for name in self.models}


def test_the_first_list_is_waited_for_and_a_stale_one_is_refreshed_in_the_background():
    coordinator = Coordinator()
    models = ServedModels(coordinator, refresh_s=0.0, wait_s=1.0)

    async def scenario():
        await models.fresh()  # nothing yet: waited for
        assert [s.name for s in models.listed()] == ["demo"] and models.ready()
        coordinator.delay, coordinator.models = 0.5, ["demo", "other"]
        start = time.monotonic()
        await models.fresh()  # stale: refreshed behind the caller
        await models.fresh()  # one refresh at a time
        assert time.monotonic() - start < 0.25
        await asyncio.sleep(0.05)  # the refresh under way
        assert coordinator.calls == 2 and [s.name for s in models.listed()] == ["demo"]  # the list the callers had
        await asyncio.sleep(0.7)
        assert sorted(s.name for s in models.listed()) == ["demo", "other"]

    asyncio.run(scenario())


def test_a_failed_background_refresh_makes_the_gateway_unready_until_one_succeeds():
    coordinator = Coordinator()
    models = ServedModels(coordinator, refresh_s=0.0, wait_s=1.0)

    async def scenario():
        await models.fresh()
        coordinator.fail = True
        await models.fresh()
        await asyncio.sleep(0.05)
        assert not models.ready()
        coordinator.fail = False
        await models.fresh()
        await asyncio.sleep(0.05)
        assert models.ready()

    asyncio.run(scenario())


def test_a_model_no_node_serves_yet_is_waited_for_then_refused():
    coordinator = Coordinator(models=["demo"])
    models = ServedModels(coordinator, refresh_s=60.0, wait_s=1.0)

    async def no_load(spec):  # the tokenizer load is not what this tests
        spec.tokenizer = "tokenizer"
        return spec.tokenizer

    models.tokenizer = no_load

    async def scenario():
        asyncio.get_running_loop().call_later(0.1, coordinator.models.append, "late")
        assert (await models.spec("late")).tokenizer == "tokenizer"  # its node registered meanwhile
        with pytest.raises(UnknownModel, match="other"):
            await models.spec("other")

    asyncio.run(scenario())
