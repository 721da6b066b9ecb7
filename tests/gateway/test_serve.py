"""`orchard serve`: its safety checks, and a real process that drains on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from orchard.cluster.cli.serve_options import InsecureBind, api_keys, check_bind, is_loopback

ORCHARD = Path(sys.executable).with_name("orchard")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_addresses_need_no_key(host):
    assert is_loopback(host)
    check_bind(host, frozenset())


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "example.com"])
def test_other_addresses_without_a_key_are_refused_saying_why(host):
    with pytest.raises(InsecureBind, match="without an API key"):
        check_bind(host, frozenset())
    check_bind(host, frozenset({"k"}))


def test_api_keys_come_from_flags_and_the_environment():
    assert api_keys(["a"], {"ORCHARD_API_KEYS": "b, c,,"}) == frozenset({"a", "b", "c"})
    assert api_keys([], {}) == frozenset()


def test_serve_on_all_interfaces_without_a_key_exits_before_loading_anything():
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_API_KEYS"}
    run = subprocess.run([str(ORCHARD), "serve", "--host", "0.0.0.0", "--no-ray"], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2
    assert "refusing to listen on 0.0.0.0 without an API key" in run.stderr


@pytest.mark.timeout(180)
def test_sigterm_lets_the_running_stream_finish_then_exits_cleanly():
    proc = subprocess.Popen(
        [str(ORCHARD), "serve", "--no-ray", "--port", "0", "--max-model-len", "128", "--kv-memory", "0.02", "--grace", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://\S+)/v1", line)
        assert match, line
        model, url = match.groups()
        body = {"model": model, "prompt": "drain me", "max_tokens": 40, "temperature": 0}
        expected = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            proc.send_signal(signal.SIGTERM)
            events.extend(lines)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    data = [e[6:] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == expected


def test_cold_tier_flags_turn_it_on_with_a_private_file(tmp_path):
    cold = tmp_path / "cold"
    proc = subprocess.Popen(
        [str(ORCHARD), "serve", "--no-ray", "--port", "0", "--max-model-len", "128", "--kv-memory", "0.02",
         "--cold-tier", str(cold), "--cold-tier-gb", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else line
        files = list(cold.iterdir())
        assert len(files) == 1 and files[0].stat().st_size > 0.005 * 2**30
        assert files[0].stat().st_mode & 0o777 == 0o600 and cold.stat().st_mode & 0o777 == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
