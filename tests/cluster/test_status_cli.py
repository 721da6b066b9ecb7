"""`orchard status` with no cluster running: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import os
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
