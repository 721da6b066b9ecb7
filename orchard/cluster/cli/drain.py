"""`orchard drain NODE`: stop sending a node new work and let what it runs finish."""

from __future__ import annotations

import time


def register(sub) -> None:
    p = sub.add_parser("drain", help="stop routing new requests to NODE; its running requests finish")
    p.add_argument("node", help="node id as shown by `orchard status`")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the local cluster)")
    p.add_argument("--undo", action="store_true", help="take the node back into service")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the node's running and waiting requests to reach zero")
    p.set_defaults(func=run)


def run(args) -> int:
    import ray

    from orchard.cluster.coordinator.coordinator import COORDINATOR_NAME, NAMESPACE
    from orchard.cluster.coordinator.membership import UnknownNode
    from orchard.cluster.runtime.ray_cluster import connect

    connect(args.address)
    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    try:
        row = ray.get((coordinator.undrain if args.undo else coordinator.drain).remote(args.node))
    except UnknownNode:
        print(f"no node {args.node!r}; see `orchard status`")
        return 1
    print(f"{args.node}: {row['status']}")
    if args.undo or args.wait <= 0:
        return 0
    return 0 if _wait_idle(coordinator, args.node, args.wait) else 1


def _wait_idle(coordinator, node_id: str, timeout_s: float) -> bool:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = next(n for n in ray.get(coordinator.nodes.remote()) if n["node_id"] == node_id)
        if row["running"] + row["waiting"] == 0:
            print(f"{node_id}: idle")
            return True
        time.sleep(1.0)
    print(f"{node_id}: still busy after {timeout_s:.0f} s")
    return False
