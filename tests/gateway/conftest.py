"""Live gateway servers over one in-process engine, shared by the whole gateway suite."""

from __future__ import annotations

import httpx
import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.backend import LocalBackend
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer

API_KEY = "test-key-0123456789"


def _engine():
    """The real engine on the bundled demo model, small enough for two shared cores."""
    from orchard.node.async_engine import AsyncEngine
    from orchard.node.engine import EngineConfig

    return AsyncEngine.from_config(EngineConfig(max_model_len=256, num_blocks=512, max_num_seqs=64))


@pytest.fixture(scope="session")
def engine():
    eng = _engine()
    yield eng
    shutdown = getattr(eng, "shutdown", None)
    if shutdown:
        shutdown()


class KeepEngine(LocalBackend):
    """A LocalBackend whose shutdown leaves the shared engine running for later tests."""

    async def shutdown(self) -> None:
        self._closed = True


def serve(engine, **config) -> LiveServer:
    return LiveServer(create_app(KeepEngine(engine), GatewayConfig(**config)))


@pytest.fixture(scope="session")
def server(engine):
    with serve(engine, request_timeout_s=60.0) as live:
        yield live


@pytest.fixture(scope="session")
def model_name(engine) -> str:
    return engine.model_name


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
