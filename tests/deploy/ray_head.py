"""A private Ray head for tests: its own temp dir, its own ports, stopped by process group.

`ray stop` is never used: it stops every Ray process on the machine, including clusters
that other tests (or people) run there. The head here is `ray start --block` in a session
of its own, so stopping that session stops exactly what it started.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orchard.node.serving.agent import stop_process_group

RAY = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The test clusters run Ray's token authentication, as deploy/cluster.yaml starts Ray.
RAY_TOKEN = secrets.token_hex(32)


def ray_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN, **extra}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def auth_headers() -> dict[str, str]:
    """What an HTTP client of Ray's job server sends (Ray's own CLI does the same from RAY_AUTH_TOKEN)."""
    return {"Authorization": f"Bearer {RAY_TOKEN}"}


@dataclass
class RayHead:
    """`ray start --head` with the job server (dashboard) on loopback and `orchard_node`."""

    num_cpus: int = 2
    resources: dict = field(default_factory=lambda: {"orchard_node": 1})
    start_timeout_s: float = 120.0
    temp_dir: str = ""
    gcs_port: int = 0
    dashboard_port: int = 0
    _proc: subprocess.Popen | None = None
    _log: object = None
    _workers: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def command(self) -> list[str]:
        ports = {
            "--port": self.gcs_port, "--dashboard-port": self.dashboard_port,
            "--ray-client-server-port": free_port(), "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
            "--metrics-export-port": free_port(), "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
        }
        cmd = [str(RAY), "start", "--head", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(self.num_cpus), "--resources", json.dumps(self.resources),
               "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
               "--temp-dir", self.temp_dir, "--object-store-memory", str(80 << 20)]
        for flag, port in ports.items():
            cmd += [flag, str(port)]
        return cmd

    def start(self) -> RayHead:
        # Short: raylet socket paths have a length limit.
        self.temp_dir = tempfile.mkdtemp(prefix="orc-", dir="/tmp")
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self._log = open(Path(self.temp_dir) / "ray-start.log", "w")
        self._proc = subprocess.Popen(self.command(), env=ray_env(RAY_TMPDIR=self.temp_dir), stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_for_job_server()
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, num_cpus: int = 1) -> None:
        """Another raylet on this machine joining the head, as a second machine would, with `orchard_node`."""
        ports = {flag: free_port() for flag in (
            "--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port",
            "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port")}
        cmd = [str(RAY), "start", "--block", "--address", self.address, "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(num_cpus), "--resources", json.dumps(self.resources),
               "--object-store-memory", str(80 << 20)]
        for flag, port in ports.items():
            cmd += [flag, str(port)]
        self._workers.append(subprocess.Popen(cmd, env=ray_env(RAY_TMPDIR=self.temp_dir), stdin=subprocess.DEVNULL,
                                              stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_for_job_server(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.dashboard_url + "/api/version", headers=auth_headers(), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Ray's job server did not answer within {self.start_timeout_s:.0f}s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (Path(self.temp_dir) / "ray-start.log").read_text()[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        while self._workers:
            stop_process_group(self._workers.pop(), grace_s=10)
        if self._proc is not None:
            stop_process_group(self._proc, grace_s=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
