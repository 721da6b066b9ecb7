"""Several "hosts" on one machine: Linux network namespaces on a private bridge.

The test builds its own network with `orchard.cluster.bench.netns`: a switch namespace holding a
bridge, and one namespace per host (head, node, rogue) wired to it by a veth pair,
addressed in 10.213.0.0/24 (unshaped).
Nothing is routed anywhere else and nothing touches the machine's own namespace; every
process started in those namespaces is killed and the namespaces deleted afterwards,
whatever happened. Needs root (`ip netns add`); skipped otherwise.

Phases, each a real `orchard head` / `orchard join` process:
1. the head creates a token; the node, holding a copy, finds and joins it within 20 s;
   a rogue in a third namespace advertises the same cluster name signed with another
   token and is never contacted;
2. the head restarts (new head id); the node joins the new head by itself;
3. the node is stopped with SIGTERM; the head's Ray sees it gone.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchard.cluster.bench.netns import NetLab, unavailable
from orchard.cluster.bench.netns import stop as _stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SUBNET = "10.213.0"
HOSTS = {"head": f"{SUBNET}.2", "node": f"{SUBNET}.3", "rogue": f"{SUBNET}.4"}
CLUSTER = "netns"
JOIN_DEADLINE_S = 20.0


# Lists the Ray nodes the GCS knows, as JSON, without starting a driver (about 1 s).
_PROBE = textwrap.dedent("""
    import json, sys, time
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    address, want, ip, deadline = sys.argv[1], sys.argv[2], sys.argv[3], time.time() + float(sys.argv[4])
    while True:
        try:
            nodes = [dict(ip=n.node_manager_address, alive=n.state == GcsNodeInfo.ALIVE,
                          resources=dict(n.resources_total), labels=dict(n.labels))
                     for n in GcsClient(address=address).get_all_node_info(timeout=5).values()]
        except Exception as exc:
            nodes = None
        if nodes is not None:
            serving = [n for n in nodes if n["alive"] and n["ip"] == ip and n["resources"].get("orchard_node")]
            if (want == "joined") == bool(serving) or time.time() > deadline:
                print(json.dumps(nodes)); break
        elif time.time() > deadline:
            print("null"); break
        time.sleep(0.5)
""")


@pytest.fixture
def lab(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    net = NetLab(tmp_path, cwd=ROOT)
    try:
        net.build(HOSTS)
        yield net
    finally:
        net.close()


def _env(config_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ORCHARD_"))}
    env.update(ORCHARD_CONFIG_DIR=str(config_dir), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT), **extra)
    return env


def _orchard(*args: str) -> list[str]:
    return [PYTHON, "-m", "orchard.cluster.cli", *args]


def _head_argv(tmp: Path) -> list[str]:
    return _orchard("head", "--cluster", CLUSTER, "--bind", HOSTS["head"], "--ray-only", "--num-cpus", "1",
                    "--object-store-mb", "80", "--ray-temp-dir", f"/tmp/orj-{tmp.name[-6:]}-h")


def _wait_for(predicate, timeout_s: float, what: str, log: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{log[-3000:]}")


def _probe(lab: NetLab, ray_token: str, want: str, timeout_s: float) -> list[dict]:
    env = _env(lab.workdir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token)
    out = lab.run("head", [PYTHON, "-c", _PROBE, f"{HOSTS['head']}:6379", want, HOSTS["node"], str(timeout_s)],
                  env, timeout=timeout_s + 30)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _serving_node(nodes: list[dict] | None) -> dict | None:
    alive = [n for n in nodes or [] if n["alive"] and n["ip"] == HOSTS["node"] and n["resources"].get("orchard_node")]
    return alive[0] if alive else None


def _log(lab: NetLab, name: str) -> str:
    path = lab.workdir / name
    return path.read_text(errors="replace") if path.exists() else ""


def test_node_joins_by_itself_ignores_a_rogue_rejoins_a_restarted_head_and_leaves(lab, tmp_path):
    from orchard.cluster.discovery import cluster_token as ct

    head_cfg, node_cfg, rogue_cfg = (tmp_path / f"{r}-cfg" for r in ("head", "node", "rogue"))

    # The rogue claims our cluster name with a token of its own and listens where it points.
    rogue = lab.start("rogue", [PYTHON, "-c", _ROGUE, HOSTS["rogue"], str(tmp_path / "rogue-contacts")],
                      _env(rogue_cfg), "rogue.log")

    head = lab.start("head", _head_argv(tmp_path), _env(head_cfg), "head-1.log")
    _wait_for(lambda: "Ray at" in _log(lab, "head-1.log"), 90, "the head to start", _log(lab, "head-1.log"))
    head_log = _log(lab, "head-1.log")
    token = ct.load_token_file(head_cfg / f"{CLUSTER}.token")
    assert head_log.count(token) == 1, "the new token is printed exactly once"
    ray_token = ct.ray_auth_token(token)

    node_cfg.mkdir(mode=0o700)
    (node_cfg / f"{CLUSTER}.token").write_text(token)
    os.chmod(node_cfg / f"{CLUSTER}.token", 0o600)
    started = time.monotonic()
    node = lab.start("node", _orchard("join", "--cluster", CLUSTER, "--num-cpus", "1", "--object-store-mb", "80",
                                      "--ray-temp-dir", f"/tmp/orj-{tmp_path.name[-6:]}-n",
                                      "--label", "orchard/rack=ns-2", "--drain-timeout", "2"),
                     _env(node_cfg), "node.log")

    # 1. joined within 20 s, with its resource and labels; the rogue was never contacted.
    joined = _serving_node(_probe(lab, ray_token, "joined", JOIN_DEADLINE_S))
    join_s = time.monotonic() - started
    assert joined is not None, _log(lab, "node.log")[-3000:]
    assert join_s < JOIN_DEADLINE_S + 5  # the probe's own start is inside the margin
    assert joined["labels"]["orchard/rack"] == "ns-2"
    assert joined["labels"]["orchard/mlx-device"] in {"cpu", "cuda", "metal"}
    assert joined["resources"]["orchard_node"] == 1
    print(f"node joined in {join_s:.1f}s")
    _wait_for(lambda: "bad-signature" in _log(lab, "node.log") or "HMAC" in _log(lab, "node.log"), 15,
              "the rogue's advertisement to be rejected")
    assert HOSTS["rogue"] not in _joined_addresses(_log(lab, "node.log"))
    assert rogue.poll() is None and not (tmp_path / "rogue-contacts").exists()
    # Ray itself refuses a client from the rogue's namespace that holds another token.
    refused = lab.run("rogue", [PYTHON, "-c", _WRONG_TOKEN_CLIENT, f"{HOSTS['head']}:6379"],
                      _env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ct.ray_auth_token(ct.new_token())), 60)
    assert "REFUSED" in refused.stdout and "InvalidAuthToken" in refused.stdout, refused.stdout + refused.stderr[-2000:]

    # 2. the head restarts; the node notices the new head id and joins again.
    assert _stop(head, grace_s=30) == 0
    lab.start("head", _head_argv(tmp_path), _env(head_cfg), "head-2.log")
    _wait_for(lambda: "Ray at" in _log(lab, "head-2.log"), 90, "the head to restart")
    assert token not in _log(lab, "head-2.log"), "an existing token is never printed again"
    rejoined = _serving_node(_probe(lab, ray_token, "joined", 60))
    assert rejoined is not None, _log(lab, "node.log")[-3000:]
    assert _joined_addresses(_log(lab, "node.log")) == [f"{HOSTS['head']}:6379"] * 2

    # 3. SIGTERM: the node leaves cleanly and the head's Ray sees it go.
    assert _stop(node, grace_s=30) == 0
    after = _probe(lab, ray_token, "left", 30)
    assert after is not None and _serving_node(after) is None
    assert not (tmp_path / "rogue-contacts").exists()


def _joined_addresses(node_log: str) -> list[str]:
    """The --address of every `ray start` the agent ran, from its log."""
    out = []
    for line in node_log.splitlines():
        if "joining:" in line and "--address" in line:
            words = line.split()
            out.append(words[words.index("--address") + 1])
    return out


_WRONG_TOKEN_CLIENT = textwrap.dedent("""
    import sys
    from ray._raylet import GcsClient
    try:
        GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
        print("ADMITTED")
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc)
""")


# A stranger: advertises cluster "netns" with its own token; records anyone who connects.
_ROGUE = textwrap.dedent("""
    import socket, sys, threading, time
    from orchard.cluster.discovery import cluster_token as ct
    from orchard.cluster.discovery.adverts import Advertisement, Advertiser
    address, contacts = sys.argv[1], sys.argv[2]
    advert = Advertisement("netns", f"{address}:6379", f"http://{address}:8000", "0.1.0", "badbadbadbad", time.time())
    Advertiser(advert, ct.advert_key(ct.new_token()), address, refresh_s=2).start()
    server = socket.create_server((address, 6379))
    while True:
        conn, peer = server.accept()
        open(contacts, "a").write(f"{peer}\\n")
        conn.close()
""")


# ---- the whole stack: `orchard head` serving, `orchard join`, the coordinator's view ----
API_KEY = "netns-test-key-0123456789"

# Runs in the head's namespace as a Ray driver: asks the coordinator, drains, or sends a request.
_CLUSTER_PROBE = textwrap.dedent("""
    import json, sys, time
    import httpx, ray
    address, action, arg, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ray.init(address=address, namespace="orchard", log_to_driver=False, logging_level="ERROR")
    coordinator = ray.get_actor("orchard-coordinator", namespace="orchard")
    nodes = lambda: ray.get(coordinator.nodes.remote())
    deadline = time.time() + timeout
    if action == "wait-alive":  # arg: Ray node id that must have an alive row
        while not any(n["ray_node_id"] == arg and n["status"] == "alive" for n in nodes()) and time.time() < deadline:
            time.sleep(0.3)
    elif action == "wait-gone":
        while any(n["ray_node_id"] == arg and n["status"] == "alive" for n in nodes()) and time.time() < deadline:
            time.sleep(0.3)
    elif action == "drain-others":  # only the node `arg` keeps taking work
        for n in nodes():
            if n["ray_node_id"] != arg:
                ray.get(coordinator.drain.remote(n["node_id"]))
    elif action == "complete":
        auth = {"Authorization": "Bearer netns-test-key-0123456789"}  # API_KEY
        model = httpx.get(arg + "/v1/models", headers=auth, timeout=timeout).json()["data"][0]["id"]
        r = httpx.post(arg + "/v1/completions", timeout=timeout, headers=auth,
                       json={"model": model, "prompt": "hello orchard", "max_tokens": 4, "temperature": 0})
        print("RESPONSE " + json.dumps({"status": r.status_code, "body": r.json()}))
        decisions = ray.get(coordinator.recent_decisions.remote())
        print("DECISIONS " + json.dumps(decisions))
        served = lambda: [n["requests_total"] for n in nodes() if n["node_id"] == decisions[-1]["node_id"]]
        while served() == [0] and time.time() < deadline:
            time.sleep(0.3)  # served counts arrive with the next heartbeat
    print("NODES " + json.dumps(nodes()))
""")


def _cluster(lab: NetLab, ray_token: str, action: str, arg: str, timeout_s: float) -> tuple[list[dict], dict | None]:
    env = _env(lab.workdir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token)
    out = lab.run("head", [PYTHON, "-c", _CLUSTER_PROBE, f"{HOSTS['head']}:6379", action, arg, str(timeout_s)], env,
                  timeout=timeout_s + 60)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
             if line.startswith(("NODES ", "RESPONSE ", "DECISIONS "))}
    if "DECISIONS" in lines:
        lines["RESPONSE"]["decisions"] = lines["DECISIONS"]
    return lines["NODES"], lines.get("RESPONSE")


def _full_head_argv(tmp: Path) -> list[str]:
    return _orchard("head", "--cluster", CLUSTER, "--bind", HOSTS["head"], "--num-cpus", "1", "--object-store-mb", "80",
                    "--ray-temp-dir", f"/tmp/orj-{tmp.name[-6:]}-h", "--api-key", API_KEY, "--max-num-seqs", "4",
                    "--kv-memory", "0.05", "--grace", "5")


def _row(nodes: list[dict], ray_node_id: str) -> dict | None:
    rows = [n for n in nodes if n["ray_node_id"] == ray_node_id]
    return rows[-1] if rows else None


def test_orchard_head_and_join_make_one_serving_cluster(lab, tmp_path):
    from orchard.cluster.discovery import cluster_token as ct

    head_cfg, node_cfg = tmp_path / "head-cfg", tmp_path / "node-cfg"
    rogue = lab.start("rogue", [PYTHON, "-c", _ROGUE, HOSTS["rogue"], str(tmp_path / "rogue-contacts")],
                      _env(tmp_path / "rogue-cfg"), "rogue.log")
    head = lab.start("head", _full_head_argv(tmp_path), _env(head_cfg), "head-1.log")
    _wait_for(lambda: "gateway at" in _log(lab, "head-1.log") or head.poll() is not None, 300, "the head to serve")
    assert head.poll() is None, _log(lab, "head-1.log")[-3000:]
    token = ct.load_token_file(head_cfg / f"{CLUSTER}.token")
    ray_token = ct.ray_auth_token(token)
    node_cfg.mkdir(mode=0o700)
    (node_cfg / f"{CLUSTER}.token").write_text(token)
    os.chmod(node_cfg / f"{CLUSTER}.token", 0o600)

    started = time.monotonic()
    node = lab.start("node", _orchard("join", "--cluster", CLUSTER, "--num-cpus", "1", "--object-store-mb", "80",
                                      "--ray-temp-dir", f"/tmp/orj-{tmp_path.name[-6:]}-n", "--drain-timeout", "5"),
                     _env(node_cfg), "node.log")
    ray_node = _serving_node(_probe(lab, ray_token, "joined", JOIN_DEADLINE_S))
    assert ray_node is not None, _log(lab, "node.log")[-3000:]
    node_id = ray_node["labels"]["ray.io/node-id"]
    nodes, _ = _cluster(lab, ray_token, "wait-alive", node_id, JOIN_DEADLINE_S)
    appeared_s = time.monotonic() - started
    assert _row(nodes, node_id) is not None and _row(nodes, node_id)["status"] == "alive", (
        nodes, _log(lab, "head-1.log")[-3000:])
    print(f"node in the coordinator's membership {appeared_s:.1f}s after `orchard join` started")
    status = lab.run("head", _orchard("status", "--address", f"{HOSTS['head']}:6379", "--json"),
                     _env(lab.workdir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token), 60)
    assert status.returncode == 0, status.stderr[-2000:]
    assert "Connecting to existing Ray cluster" not in status.stderr + status.stdout  # no Ray INFO lines in the CLI
    status_rows = {n["ray_node_id"]: n["status"] for n in json.loads(status.stdout)["nodes"]}
    assert status_rows[node_id] == "alive"
    assert appeared_s < JOIN_DEADLINE_S + 10  # the probes' own Ray drivers start inside the margin

    # A request with every other node drained must be served by the joined node.
    _cluster(lab, ray_token, "drain-others", node_id, 30)
    nodes, response = _cluster(lab, ray_token, "complete", f"http://{HOSTS['head']}:8000", 120)
    assert response["status"] == 200, response
    assert response["body"]["usage"]["completion_tokens"] == 4
    assert response["decisions"][-1]["node_id"] == _row(nodes, node_id)["node_id"]  # earlier: the warm-up
    assert _row(nodes, node_id)["requests_total"] == 1
    assert rogue.poll() is None and not (tmp_path / "rogue-contacts").exists()

    # The head restarts: the node joins the new head and the new coordinator lists it.
    assert _stop(head, grace_s=60) == 0
    lab.start("head", _full_head_argv(tmp_path), _env(head_cfg), "head-2.log")
    _wait_for(lambda: "gateway at" in _log(lab, "head-2.log"), 300, "the head to serve again", _log(lab, "head-2.log"))
    ray_node = _serving_node(_probe(lab, ray_token, "joined", 60))
    assert ray_node is not None, _log(lab, "node.log")[-3000:]
    node_id = ray_node["labels"]["ray.io/node-id"]
    nodes, _ = _cluster(lab, ray_token, "wait-alive", node_id, 60)
    assert _row(nodes, node_id)["status"] == "alive"

    # The node leaves (SIGTERM drains it first); the coordinator stops counting it as alive.
    assert _stop(node, grace_s=60) == 0
    nodes, _ = _cluster(lab, ray_token, "wait-gone", node_id, 30)
    assert _row(nodes, node_id) is None or _row(nodes, node_id)["status"] != "alive"
    assert "draining" in _log(lab, "node.log")
