"""`orchard serve` on its own Ray: stopped while starting, and replacing a node actor that died."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ORCHARD = Path(sys.executable).with_name("orchard")


def wait_for(log: Path, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := re.search(pattern, log.read_text()):
            return match
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in\n{log.read_text()[-3000:]}")


@pytest.mark.timeout(240)
def test_sigterm_while_ray_starts_exits_cleanly_and_removes_its_temp_folder(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--port", "0", "--kv-memory", "0.02"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        temp = Path(wait_for(log, r"temp folder (/tmp/orc-\S+)\)", 120).group(1))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, 143), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not temp.exists()
    assert "Connecting to existing Ray cluster" not in log.read_text()


def node_actor_pids(root: int) -> list[int]:
    """Processes under `root` whose title Ray set to the node actor's."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
    children: dict[int, list[int]] = {}
    for pid, ppid, *_ in rows:
        children.setdefault(int(ppid), []).append(int(pid))
    under, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            under.add(child)
            todo.append(child)
    return [int(pid) for pid, _, *args in rows if int(pid) in under and args and args[0].startswith("ray::NodeActor")]


@pytest.mark.timeout(420)
@pytest.mark.skip(reason="the replacement is not seen yet: see the report of issue 18")
def test_serve_nodes_replaces_a_node_actor_that_died(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--nodes", "2", "--port", "0", "--kv-memory", "0.02",
                                 "--max-model-len", "128"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        url = re.search(r"at (http://\S+)/v1", proc.stdout.readline()).group(1)
        pids = node_actor_pids(proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            now = node_actor_pids(proc.pid)
            nodes = httpx.get(url + "/v1/cluster", timeout=30).json().get("nodes", [])
            healthy = [n for n in nodes if n.get("status") in (None, "healthy", "ready", "serving")]
            if len(now) == 2 and pids[0] not in now and len(healthy) >= 2:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"no replacement: {now} {nodes}\n{log.read_text()[-3000:]}")
        done = httpx.post(url + "/v1/completions", timeout=120,
                          json={"model": re.search(r"model (\S+)", log.read_text()).group(1), "prompt": "hi",
                                "max_tokens": 3})
        assert done.status_code == 200, done.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
