"""`orchard join`: make this machine a serving node of a cluster and keep it one.

It finds the head by its signed zeroconf advertisement (or takes `--head ADDRESS` where
multicast does not reach), then hands the sightings to the join agent, which runs this
machine's Ray node and joins again whenever the head restarts. SIGTERM (systemd, launchd,
Ctrl-C) drains the node through the coordinator before Ray stops.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import time
from pathlib import Path

from orchard.cluster.cli.lifecycle import stop_on_signals
from orchard.cluster.runtime.head import DEFAULT_CLUSTER, DEFAULT_RAY_PORT

log = logging.getLogger("orchard.join")


def register(sub) -> None:
    p = sub.add_parser("join", help="join this machine to a cluster as a serving node (finds the head by itself)",
                       description="Find the cluster's head over zeroconf (or at --head), join its Ray "
                                   "cluster as a serving node and stay joined across head restarts.")
    p.add_argument("--cluster", default=os.environ.get("ORCHARD_CLUSTER", DEFAULT_CLUSTER),
                   help="cluster name to look for (default: $ORCHARD_CLUSTER or %(default)s)")
    p.add_argument("--head", metavar="HOST[:PORT]",
                   help="the head's Ray address; skips discovery (networks without multicast)")
    p.add_argument("--token-file", type=Path,
                   help="file holding the cluster token (default: $ORCHARD_CLUSTER_TOKEN, else "
                        "<config dir>/<cluster>.token)")
    p.add_argument("--num-cpus", type=int, help="CPUs this node offers Ray (default: all)")
    p.add_argument("--node-ip", metavar="ADDRESS", help="this machine's address as the head sees it "
                                                          "(default: the one that reaches the head)")
    p.add_argument("--object-store-mb", type=int, help="Ray object store size in MiB")
    p.add_argument("--ray-temp-dir", help="Ray's temp folder on this machine")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Ray node label, e.g. orchard/rack=shelf-2 (repeatable)")
    p.add_argument("--cold-tier", default=None, metavar="DIR",
                   help="this machine's own cold tier (a file per node, 0600 in a 0700 folder); "
                        "default: the head's --cold-tier setting, if any")
    p.add_argument("--cold-tier-gb", type=float, default=4.0, metavar="GB",
                   help="size of this machine's cold tier per node (default %(default)s)")
    p.add_argument("--replay-window", type=float, default=60.0, metavar="SECONDS",
                   help="accept advertisements whose timestamp is within this many seconds of now")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, wait up to this long for running requests before leaving")
    p.set_defaults(func=run)


def run(args) -> int:
    from orchard.cluster.discovery import cluster_token as ct
    from orchard.cluster.runtime.ray_access import require_token_auth
    from orchard.node.serving.agent import JoinAgent

    _setup_logging()
    try:
        token = ct.load_token_file(args.token_file) if args.token_file else ct.load_token(args.cluster)
        config = agent_config(args)
    except (ct.ClusterTokenError, ValueError) as exc:
        print(f"orchard join: {exc}", file=sys.stderr)
        return 2
    ray_token = ct.ray_auth_token(token)
    # Before anything imports Ray: its config reads the auth mode once, at import. A node of
    # a head on this machine's loopback keeps its own Ray ports on loopback too.
    require_token_auth(ray_token, loopback=head_is_loopback(args.head))
    agent = JoinAgent(config, ray_token, drain=lambda: drain_this_node(agent, args.drain_timeout))
    stop = stop_on_signals("leaving the cluster")
    watcher = _watch_head(args, agent, ct.advert_key(token))
    try:
        return agent.run(stop)
    finally:
        if watcher is not None:
            watcher.close()


def agent_config(args):
    """The join agent's settings from the command line (ValueError names a bad one)."""
    from orchard.node.serving.agent import AgentConfig

    return AgentConfig(
        num_cpus=args.num_cpus,
        node_ip=args.node_ip,
        ray_temp_dir=args.ray_temp_dir,
        object_store_memory=args.object_store_mb << 20 if args.object_store_mb else None,
        extra_labels=parse_labels(args.label),
        cold_tier_dir=args.cold_tier,
        cold_tier_gb=check_cold_tier_gb(args.cold_tier_gb),
    )


def parse_labels(pairs: list[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"label {pair!r} is not KEY=VALUE")
        labels[key] = value
    return labels


def check_cold_tier_gb(gb: float) -> float:
    if not gb > 0:
        raise ValueError(f"--cold-tier-gb must be more than 0, not {gb:g}")
    return gb


def static_head_address(head: str) -> str:
    return head if ":" in head else f"{head}:{DEFAULT_RAY_PORT}"


def head_is_loopback(head: str | None) -> bool:
    """Whether `--head` names this machine's loopback (a discovered head never does: it is not advertised)."""
    if not head:
        return False
    for host in (head, head.rpartition(":")[0]):
        host = host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            continue
    return False


def _watch_head(args, agent, key: bytes):
    """Report the head to the agent: once for --head, else on every valid advertisement."""
    from orchard.cluster.discovery.adverts import AdvertBrowser, AdvertVerifier, instance_name
    from orchard.node.serving.agent import HeadSighting

    if args.head:
        agent.head_seen(HeadSighting(static_head_address(args.head)))
        return None

    def seen(advert) -> None:
        agent.head_seen(HeadSighting(advert.ray_address, advert.head_id))

    def gone(name: str) -> None:
        joined = agent.joined
        if joined is not None and name == instance_name(args.cluster, joined.head_id):
            log.info("the head said goodbye")
            agent.head_gone()

    browser = AdvertBrowser(AdvertVerifier(args.cluster, key, args.replay_window), seen, gone)
    browser.start()
    log.info("looking for cluster %r on the local network", args.cluster)
    return browser


def drain_this_node(agent, timeout_s: float) -> None:
    """Ask the coordinator to stop routing here and wait until this node is idle.

    Connects to the cluster as a short-lived driver, finds this agent's Ray node by the
    label only it carries, and drains the coordinator's rows for that node.
    """
    import ray

    from orchard.cluster.coordinator.coordinator import COORDINATOR_NAME, NAMESPACE
    from orchard.node.serving.agent import LABEL_AGENT

    joined = agent.joined
    if joined is None or timeout_s <= 0:
        return
    ray.init(address=joined.ray_address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    try:
        try:
            coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
        except ValueError:
            log.info("no coordinator in the cluster; nothing to drain")
            return
        here = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Labels", {}).get(LABEL_AGENT) == agent.instance_id}
        mine = [n["node_id"] for n in ray.get(coordinator.nodes.remote(), timeout=10) if n["ray_node_id"] in here]
        for node_id in mine:
            ray.get(coordinator.drain.remote(node_id), timeout=10)
            log.info("draining %s", node_id)
        _wait_idle(coordinator, set(mine), timeout_s)
    finally:
        ray.shutdown()


def _wait_idle(coordinator, node_ids: set[str], timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while node_ids and time.monotonic() < deadline:
        rows = [n for n in ray.get(coordinator.nodes.remote(), timeout=10) if n["node_id"] in node_ids]
        if all(n["running"] + n["waiting"] == 0 for n in rows):
            return
        time.sleep(0.5)
    if node_ids:
        log.warning("node still busy after %.0fs; leaving anyway", timeout_s)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)

