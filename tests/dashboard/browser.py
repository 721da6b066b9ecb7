"""Headless Chromium driven over the DevTools protocol on a pipe (no websocket library needed).

`--remote-debugging-pipe` makes Chromium read protocol messages from fd 3 and write its
own to fd 4, each a JSON document ended by a NUL byte. A reader thread files replies by
id; `evaluate` runs an expression in the page and returns its value.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-quic", "--remote-debugging-pipe",
    "--window-size=1280,900",
]


class BrowserError(RuntimeError):
    """Chromium answered a command with an error, or stopped answering."""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, binary: str, timeout_s: float = 60.0):
        self.binary = binary
        self.timeout_s = timeout_s
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self._profile = ""
        self._proc: subprocess.Popen | None = None
        self._session = ""

    def __enter__(self) -> Chromium:
        self._profile = tempfile.mkdtemp(prefix="orchard-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # bash (dash takes single-digit fds only) puts the pipe ends on fds 3 and 4, where Chromium expects them.
        script = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        cmd = ["bash", "-c", script, "bash", self.binary, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"]
        # The test run may preload OpenBLAS for MLX; Chromium's renderers must not inherit it.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        self._proc = subprocess.Popen(cmd, pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close", timeout_s=10)
        except (BrowserError, OSError):
            pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, 9)
                self._proc.wait()
        try:
            os.close(self._to_browser)
        except OSError:
            pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # ---- protocol ------------------------------------------------------------------
    def send(self, method: str, params: dict | None = None, *, page: bool = False, timeout_s: float | None = None):
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
            self._replies[msg_id] = queue.Queue(maxsize=1)
        message = {"id": msg_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        try:
            reply = self._replies[msg_id].get(timeout=timeout_s or self.timeout_s)
        except queue.Empty:
            raise BrowserError(f"no reply to {method}") from None
        finally:
            self._replies.pop(msg_id, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                reply = json.loads(raw)
                waiting = self._replies.get(reply.get("id"))
                if waiting is not None:
                    waiting.put(reply)
        os.close(self._from_browser)

    # ---- page helpers --------------------------------------------------------------
    def open(self, url: str, width: int = 1280, height: int = 900) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, page=True)
        self.send("Page.navigate", {"url": url}, page=True)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, page=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, every_s: float = 0.25):
        """Until `expression` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except BrowserError:
                last = None  # the page may be between documents
            if last:
                return last
            time.sleep(every_s)
        raise BrowserError(f"timed out waiting for {expression!r} (last value {last!r})")

    def screenshot(self, path: str) -> int:
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, page=True)["data"])
        with open(path, "wb") as f:
            f.write(data)
        return len(data)
