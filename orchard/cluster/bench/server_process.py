"""A server the benchmarks start in a process of its own, and stop: ready once a path answers 200."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx


class ServerDidNotStart(RuntimeError):
    """A server process exited or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in its own session, ready once `ready_path` answers 200; stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, timeout_s: float):
        self.name, self.cmd, self.port, self.ready_path, self.timeout_s = name, cmd, port, ready_path, timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self._proc: subprocess.Popen | None = None
        # a file, not a pipe: a server that logs every request would block once a pipe nobody reads is full
        self._log = tempfile.TemporaryFile(mode="w+")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what the server wrote to stderr (its request log, a traceback if it died)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def check_alive(self) -> None:
        """Raise with the server's last words if it has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            raise ServerDidNotStart(f"{self.name} exited with {self._proc.returncode}: {self.log_tail()}")

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONFAULTHANDLER": "1"}  # a crash prints every thread's stack
        self._proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=self._log, text=True, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise ServerDidNotStart(f"{self.name} did not answer {self.ready_path} within {self.timeout_s:.0f}s")

    def __exit__(self, exc_type=None, exc=None, tb=None) -> None:
        if isinstance(exc, httpx.HTTPError):
            self.check_alive()  # a request failed because the server died: say why
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
