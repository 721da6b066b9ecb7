"""`orchard status`: the cluster as the coordinator sees it, one row per node; or, with `--url`,
as a running gateway reports it (`GET /v1/cluster`), which also covers `orchard serve --no-ray`."""

from __future__ import annotations

import json
import os
import socket
import sys

NO_CLUSTER = "orchard status: no orchard cluster is running{where} (start one with `orchard head`, or `orchard serve`)"


def register(sub) -> None:
    p = sub.add_parser("status", help="show the cluster's nodes, KV use, hit rates and requests")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the local cluster)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="ask this gateway instead of Ray (e.g. http://127.0.0.1:8000; works with `serve --no-ray`)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the gateway's API key for --url (default: one of ORCHARD_API_KEYS)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    if getattr(args, "url", None):
        return run_gateway(args)
    import ray

    from orchard.cluster.coordinator.coordinator import COORDINATOR_NAME, NAMESPACE
    from orchard.cluster.runtime.ray_cluster import connect

    where = "" if args.address in ("auto", "", None) else f" at {args.address}"
    address = local_cluster_address() if args.address in ("auto", "", None) else args.address
    if address is None or not reachable(address):
        print(NO_CLUSTER.format(where=where), file=sys.stderr)
        return 1
    try:
        connect(address)
    except ConnectionError:  # Ray found no running instance to join
        print(NO_CLUSTER.format(where=where), file=sys.stderr)
        return 1
    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        print("orchard status: no orchard coordinator in this Ray cluster (start one with `orchard head`)", file=sys.stderr)
        return 1
    info = ray.get(coordinator.cluster_info.remote())
    if args.json:
        print(json.dumps(info, indent=2, default=_hex))
    else:
        print_table(info)
    return 0


def run_gateway(args) -> int:
    """The table from a gateway's `/v1/cluster`; one line and exit 1 when it cannot be read."""
    import httpx

    from orchard.cluster.cli.serve_options import api_keys

    key = args.api_key or min(api_keys([], dict(os.environ)), default=None)  # any of the gateway's keys will do
    url = args.url.rstrip("/") + "/v1/cluster"
    try:
        reply = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10.0)
    except httpx.HTTPError as exc:
        print(f"orchard status: no gateway answers at {args.url} ({exc.__class__.__name__})", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        print(f"orchard status: {url} answered {reply.status_code}: {_error_message(reply)}", file=sys.stderr)
        return 1
    info = reply.json()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_gateway_table(info)
    return 0


def _error_message(reply) -> str:
    """The message of an error in the gateway's (OpenAI's) shape, else the body as text."""
    try:
        return reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply.text


def local_cluster_address() -> str | None:
    """The cluster this machine started last (`RAY_ADDRESS`, or the address file `ray start` and
    `orchard head` leave in Ray's temp dir); None when there is none. Ray's own "auto" would
    also attach to any Ray process it finds running here, someone else's included."""
    from ray._private.utils import read_ray_address

    return os.environ.get("RAY_ADDRESS") or read_ray_address()


def reachable(address: str | None, timeout_s: float = 2.0) -> bool:
    """Whether a `host:port` address answers at all (Ray itself would retry for a minute or more);
    "auto" is left to Ray, which answers at once when no local cluster runs."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def print_table(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"orchard cluster — router: {info['policy']}")
    _node_column(table, [n["node_id"] for n in info["nodes"]])
    for column in ("model", "status", "device", "KV used", "indexed", "hit rate", "requests", "run/wait"):
        table.add_column(column)
    for n in info["nodes"]:
        used = _kv_used(n["kv_blocks_used"], n["kv_blocks_total"] or 0)
        table.add_row(
            n["node_id"], n["model"], n["status"], n["device"], used, str(n["indexed_blocks"]),
            f"{n['prefix_hit_rate']:.1%}", str(n["requests_total"]), f"{n['running']}/{n['waiting']}",
        )
    routing = info["routing"]
    console = Console()
    console.print(table)
    console.print(
        f"index: {info['index']['blocks']} blocks, {info['index']['entries']} entries; "
        f"routed {routing['requests']} requests, routed hit rate {routing['routed_hit_rate']:.1%}"
    )


def print_gateway_table(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"orchard gateway — model: {info['model']}")
    _node_column(table, [n["node"] for n in info["nodes"]])
    for column in ("KV used", "hit rate", "run/wait"):
        table.add_column(column)
    for n in info["nodes"]:
        table.add_row(n["node"], _kv_used(n["kv_blocks_used"], n["kv_blocks_total"]),
                      f"{n['prefix_cache_hit_rate']:.1%}", f"{n['running']}/{n['waiting']}")
    console = Console()
    console.print(table)
    console.print(f"KV {_kv_used(info['kv_blocks_used'], info['kv_blocks_total'])}, "
                  f"hit rate {info['prefix_cache_hit_rate']:.1%}, queue {info['queue_depth']}")


def _node_column(table, node_ids: list[str]) -> None:
    """Node ids are printed whole, however narrow the terminal: `orchard drain` takes them as shown."""
    table.add_column("node", no_wrap=True, min_width=max(map(len, node_ids), default=4))


def _kv_used(used: int, total: int) -> str:
    return f"{used}/{total}" + (f" ({used / total:.0%})" if total else "")


def _hex(value):
    return value.hex() if isinstance(value, bytes) else str(value)
