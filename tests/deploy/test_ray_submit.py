"""deploy/cluster.yaml under Ray's cluster launcher: Ray's own validation, then for real
`ray up` + `ray submit deploy/cluster.yaml deploy/serve.py` against a head on loopback
reached through an SSH server the test starts.

The launched config is deploy/cluster.yaml with what cannot apply here replaced: the head
is 127.0.0.1 (through the test's sshd), there are no workers, the test's virtualenv stands
in for the setup commands' fresh install, and `ray stop` is left out of the start
commands because it would stop every Ray on this machine, other tests' included. The head
start command itself is the YAML's, with private ports and a private temp dir added.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.ray_head import RAY, RAY_TOKEN, free_port, ray_env
from tests.deploy.ssh_server import SSHServer, sshd_available

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "cluster.yaml"
DRIVER = REPO / "deploy" / "serve.py"
VENV_BIN = Path(sys.executable).parent
SHIPPED_RAY = "~/mlx-orchard/.venv/bin/ray"


def shipped_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(shipped_config())
    validate_config(config)
    assert config["provider"]["type"] == "local"
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    for command in (head_start, worker_start):
        assert """--resources='{"orchard_node": 1}'""" in command
        assert "RAY_AUTH_MODE=token" in command  # Ray's token authentication on every machine
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("export RAY_AUTH_MODE=token" in c for c in config["setup_commands"])  # the driver speaks it too
    assert any("pip install" in c and "mlx-orchard/src" in c for c in config["setup_commands"])


def launcher_config(ssh: SSHServer, gcs_port: int) -> dict:
    config = shipped_config()
    head_start = config["head_start_ray_commands"][-1]
    assert SHIPPED_RAY in head_start and "--port=6379" in head_start
    private_ports = " ".join(f"--{flag}={free_port()}" for flag in (
        "ray-client-server-port", "node-manager-port", "object-manager-port", "metrics-export-port",
        "runtime-env-agent-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port"))
    head_start = (head_start.replace(SHIPPED_RAY, str(VENV_BIN / "ray")).replace("--port=6379", f"--port={gcs_port}")
                  + f" --num-cpus=2 --include-dashboard=false --object-store-memory={80 << 20} {private_ports}")
    config.update(
        cluster_name=f"orchard-test-{gcs_port}",
        provider={"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
        auth={"ssh_user": "root", "ssh_private_key": str(ssh.client_key), "ssh_proxy_command": ssh.proxy_command},
        min_workers=0, max_workers=0, file_mounts={}, setup_commands=[],
        head_start_ray_commands=[head_start],
    )
    return config


def stop_session_processes(ssh: SSHServer) -> None:
    """SIGTERM what the SSH sessions started (the driver drains first), SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        pids = ssh.pids_under()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while ssh.pids_under() and time.monotonic() < deadline:
            time.sleep(0.3)


@pytest.fixture(scope="module")
def launched():
    if not sshd_available():
        pytest.skip("needs sshd, ssh and rsync (Debian: apt-get install openssh-server rsync)")
    with SSHServer(free_port(), str(VENV_BIN), {"RAY_USAGE_STATS_ENABLED": "0"}) as ssh:
        # Ray keeps the session's temp dir, and the launcher its state file, under the server's folder.
        ssh_env = ray_env(RAY_TMPDIR=str(ssh.root / "rt"))
        with open(ssh.home / ".bashrc", "a") as bashrc:  # the sessions' Ray finds the same folder
            bashrc.write(f'export RAY_TMPDIR="{ssh.root / "rt"}"\n')
            bashrc.write("export RAY_AUTH_MODE=token\n")  # what the shipped setup_commands add
        (ssh.home / ".ray").mkdir(mode=0o700, exist_ok=True)  # what the shipped file_mounts copy
        (ssh.home / ".ray" / "auth_token").write_text(RAY_TOKEN)
        (ssh.root / "rt").mkdir()
        config_path = ssh.root / "cluster.yaml"
        config_path.write_text(yaml.safe_dump(launcher_config(ssh, free_port())))
        try:
            up = subprocess.run([str(RAY), "up", "-y", "--no-config-cache", str(config_path)], capture_output=True,
                                text=True, env=ssh_env, timeout=300, start_new_session=True)
            assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
            yield ssh, config_path, ssh_env
        finally:
            stop_session_processes(ssh)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_submit_brings_up_a_gateway_that_answers_health_and_a_completion(launched):
    ssh, config_path, env = launched
    port = free_port()
    submit = subprocess.Popen(
        [str(RAY), "submit", str(config_path), str(DRIVER), "--", "--port", str(port), "--max-model-len", "256",
         "--kv-memory", "0.05", "--grace", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert submit.poll() is None, submit.stdout.read()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "no healthy gateway within 240 s"
            time.sleep(1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "deployed over ssh", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 5
        nodes = httpx.get(url + "/v1/cluster", timeout=10).json()["nodes"]
        assert [n["status"] for n in nodes] == ["alive"]
        assert (ssh.home / "serve.py").read_text() == DRIVER.read_text()  # what ray submit uploaded
    finally:
        stop_session_processes(ssh)
        os.killpg(submit.pid, signal.SIGKILL)
        submit.wait()
