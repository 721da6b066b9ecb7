"""`ray job submit -- python deploy/serve.py` on a Ray head the test starts brings the service up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.deploy.ray_head import RAY, RayHead, auth_headers, free_port, ray_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DRIVER = Path(__file__).resolve().parents[2] / "deploy" / "serve.py"
JOB_ID = "orchard-deploy-test"
SMALL = ["--max-model-len", "256", "--kv-memory", "0.05", "--grace", "5"]


def ray_job(head: RayHead, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command, *rest = args
    return subprocess.run([str(RAY), "job", command, "--address", head.dashboard_url, *rest], capture_output=True, text=True,
                          env=ray_env(), timeout=timeout)


def wait_healthy(url: str, head: RayHead, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"no healthy gateway within {timeout_s:.0f}s; job logs:\n{ray_job(head, 'logs', JOB_ID).stdout[-4000:]}")


@pytest.fixture(scope="module")
def head():
    try:
        started = RayHead(num_cpus=2).start()
    except (RuntimeError, TimeoutError) as exc:
        pytest.skip(f"Ray's job server cannot start here: {exc}")
    try:
        yield started
    finally:
        started.stop()


def alive_nodes(url: str) -> int:
    return sum(n["status"] == "alive" for n in httpx.get(url + "/v1/cluster", timeout=10).json()["nodes"])


def test_job_submit_brings_up_a_gateway_that_answers_health_and_a_completion_and_serves_a_late_joiner(head):
    port = free_port()
    submitted = ray_job(head, "submit", "--no-wait", "--submission-id", JOB_ID, "--",
                        sys.executable, str(DRIVER), "--port", str(port), "--place-every", "1", *SMALL)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, head, timeout_s=240)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        model = models["data"][0]["id"]
        body = {"model": model, "prompt": "deployed by a job", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 6
        assert reply["choices"][0]["finish_reason"] == "length"
        assert alive_nodes(url) == 1

        head.add_worker()  # a machine joining after the driver started gets its node actor
        deadline = time.monotonic() + 120
        while alive_nodes(url) < 2:
            assert time.monotonic() < deadline, "the late joiner got no node actor"
            time.sleep(1)
        assert alive_nodes(url) == 2
    finally:
        stopped = ray_job(head, "stop", JOB_ID, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert JobSubmissionClient(head.dashboard_url, headers=auth_headers()).get_job_status(JOB_ID) == JobStatus.STOPPED
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_the_driver_refuses_to_attach_to_ray_without_token_authentication():
    env = {k: v for k, v in ray_env().items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run([sys.executable, str(DRIVER), "--port", str(free_port())], capture_output=True, text=True,
                             env=env, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "RAY_AUTH_MODE is not 'token'" in refused.stderr
