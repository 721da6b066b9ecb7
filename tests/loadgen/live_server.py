"""Start and stop an OpenAI-compatible server on loopback for the live tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

from orchard.node.openblas import find_openblas


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@contextlib.contextmanager
def mlx_lm_server(model_path: str, log_path: str):
    """`python -m mlx_lm.server` on 127.0.0.1, OpenBLAS preloaded when present."""
    port = free_port()
    env = dict(os.environ)
    if (blas := find_openblas()) and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = blas
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "WARNING"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base + "/health", proc)
        yield base
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server this test started; kill it if it will not go."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
