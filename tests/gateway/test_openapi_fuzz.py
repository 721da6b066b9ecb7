"""schemathesis over /openapi.json: hundreds of generated requests, no 5xx, every response as declared.

Every check runs but `positive_data_acceptance`: limits that depend on the served model
(its vocabulary, its context length) make some schema-valid requests a correct 400.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import serve

ST = Path(sys.executable).with_name("st")
#: The Anthropic Messages and OpenAI Responses routes: schemas so large that the full run's coverage
#: phase alone takes minutes over them; they get a fuzzing-only run of their own below.
AGENT_APIS = "^/v1/(messages|responses)"


@pytest.fixture(scope="module")
def short_context_server():
    """A short context bounds every generated request's work, so the fuzz run stays fast."""
    from orchard.node.async_engine import AsyncEngine
    from orchard.node.engine import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(max_model_len=48, num_blocks=512, max_num_seqs=64))
    try:
        with serve(engine, max_chat_tokens=8, request_timeout_s=60.0) as live:
            yield live
    finally:
        engine.shutdown()


def answered(url: str) -> dict[str, int]:
    """orchard_requests_total by status, over the API endpoints."""
    totals: dict[str, int] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "orchard_requests_total" and sample.labels["endpoint"] != "/metrics":
                status = sample.labels["status"]
                totals[status] = totals.get(status, 0) + int(sample.value)
    return totals


@pytest.mark.timeout(300)
def test_generated_requests_get_no_5xx_and_match_the_schema(short_context_server, tmp_path):
    url = short_context_server.url
    run = subprocess.run(
        [str(ST), "run", url + "/openapi.json", "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "60", "--workers", "1",
         "--exclude-path-regex", AGENT_APIS,
         "--seed", "20240601", "--generation-database", "none", "--no-color", "--request-timeout", "60"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env={**os.environ, "NO_COLOR": "1"},
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    totals = answered(url)
    assert sum(totals.values()) >= 500, totals
    assert not [s for s in totals if s.startswith("5")], totals


@pytest.mark.timeout(200)
def test_the_agent_apis_get_no_5xx_and_match_their_schemas(short_context_server, tmp_path):
    run = subprocess.run(
        [str(ST), "run", short_context_server.url + "/openapi.json", "--checks", "all", "--exclude-checks",
         "positive_data_acceptance", "--include-path-regex", AGENT_APIS, "--phases", "examples,fuzzing",
         "--max-examples", "25", "--workers", "1", "--seed", "20240601", "--generation-database", "none", "--no-color",
         "--request-timeout", "60"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env={**os.environ, "NO_COLOR": "1"},
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "4 selected" in run.stdout, run.stdout[-2000:]
