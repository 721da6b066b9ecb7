"""`orchard serve` on its own Ray: stopped while starting, and replacing a node actor that died."""

from __future__ import annotations

import asyncio
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


def node_of(pid: int) -> str:
    """The orchard node id of a node actor's process: the first 8 hex digits of its raylet's Ray node id."""
    raylet = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    args = Path(f"/proc/{raylet}/cmdline").read_text().split("\0")
    return next(a.split("=", 1)[1][:8] for a in args if a.startswith("--node_id="))


def alive_nodes(url: str) -> dict[str, dict]:
    nodes = httpx.get(url + "/v1/cluster", timeout=30).json().get("nodes", [])
    return {n["node"]: n for n in nodes if n.get("status") == "alive"}


def complete_concurrently(url: str, model: str, n: int) -> list[int]:
    """`n` completions at once (distinct prompts), so the router spreads them by load."""
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": model, "prompt": f"request {i} of the batch", "max_tokens": 4}) for i in range(n)))
            return [r.status_code for r in replies]

    return asyncio.run(go())


@pytest.mark.timeout(180)
def test_serve_nodes_replaces_a_node_actor_that_died_and_routes_to_the_new_one(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(ORCHARD), "serve", "--nodes", "2", "--port", "0", "--kv-memory", "0.02",
                                 "--max-model-len", "128"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        url = re.search(r"at (http://\S+)/v1", proc.stdout.readline()).group(1)
        model = re.search(r"orchard: model (\S+)", log.read_text()).group(1)
        pids, before = node_actor_pids(proc.pid), alive_nodes(url)
        assert len(pids) == 2 and len(before) == 2, (pids, before)
        # The node that served the warm-up: the gateway holds a handle to its actor, now stale.
        replaced = next(node for node, row in before.items() if row["requests_total"] > 0)
        os.kill(next(pid for pid in pids if node_of(pid) == replaced), signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 60:
            now, nodes = node_actor_pids(proc.pid), alive_nodes(url)
            new = [pid for pid in now if pid not in pids]
            if new and node_of(new[0]) == replaced and nodes.get(replaced, {}).get("requests_total") == 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no replacement within 60 s: {now} {nodes}\n{log.read_text()[-3000:]}")
        assert complete_concurrently(url, model, 8) == [200] * 8
        served = alive_nodes(url)
        assert served[replaced]["requests_total"] > 0, served  # the new actor took requests
        assert sum(n["requests_total"] for n in served.values()) >= 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
