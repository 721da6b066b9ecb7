"""`orchard status` with no cluster running: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ORCHARD = Path(sys.executable).with_name("orchard")


def status(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    # Ray looks for "the local cluster" under its temp dir: an empty one has none, whatever
    # else runs on this machine.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), TMPDIR=str(tmp))
    return subprocess.run([str(ORCHARD), "status", *args], capture_output=True, text=True, timeout=60, env=env)


def test_status_without_a_local_cluster_prints_one_line_and_fails(tmp_path):
    run = status(tmp=tmp_path)
    assert run.returncode == 1
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert lines == ["orchard status: no orchard cluster is running (start one with `orchard head`, or `orchard serve`)"]


def test_status_at_an_address_nobody_listens_on_fails_at_once(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = status("--address", f"127.0.0.1:{port}", tmp=tmp_path)
    assert run.returncode == 1
    assert (run.stdout + run.stderr).strip().splitlines() == [
        f"orchard status: no orchard cluster is running at 127.0.0.1:{port} "
        "(start one with `orchard head`, or `orchard serve`)"]


def test_node_ids_are_printed_whole_on_a_narrow_terminal(monkeypatch, capsys):
    from orchard.cluster.cli.status import print_table

    monkeypatch.setenv("COLUMNS", "80")
    node_id = "node-" + "f3a9" * 14  # as long as a Ray node id
    row = dict(node_id=node_id, model="orchard-demo", status="alive", device="cpu", kv_blocks_used=3, kv_blocks_total=96,
               indexed_blocks=3, prefix_hit_rate=0.5, requests_total=7, running=1, waiting=0)
    print_table({"policy": "prefix", "nodes": [row], "index": {"blocks": 3, "entries": 3},
                 "routing": {"requests": 7, "routed_hit_rate": 0.5}})
    assert node_id in capsys.readouterr().out


def test_status_reads_a_no_ray_gateway_with_its_api_key(tmp_path):
    key = "status-test-key-0123456789"
    proc = subprocess.Popen(
        [str(ORCHARD), "serve", "--no-ray", "--port", "0", "--max-model-len", "128", "--kv-memory", "0.02", "--api-key", key],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else line
        url = line.split(" at ")[1].split("/v1")[0]
        table = status("--url", url, "--api-key", key, tmp=tmp_path)
        assert table.returncode == 0, table.stderr
        assert "local" in table.stdout and "KV used" in table.stdout and "queue 0" in table.stdout
        refused = status("--url", url, "--api-key", "wrong-key-0123456789", tmp=tmp_path)
        assert refused.returncode == 1 and refused.stderr.startswith(f"orchard status: {url}/v1/cluster answered 401")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
