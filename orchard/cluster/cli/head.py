"""`orchard head`: start a cluster's head and let other machines find it.

In order: the cluster token (created, stored 0600 and printed once on first start), the
Ray head with Ray's token authentication on, the coordinator and gateway attached to that
Ray (what `orchard serve --address` does), and finally the signed zeroconf advertisement.
Everything binds 127.0.0.1 unless `--bind` says otherwise; a head bound to loopback is
not advertised, since no other machine could reach it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from orchard.cluster.cli import serve, serve_options
from orchard.cluster.cli.lifecycle import stop_on_signals
from orchard.cluster.runtime.head import DEFAULT_CLUSTER, DEFAULT_GATEWAY_PORT, DEFAULT_RAY_PORT, Head, HeadConfig

#: How often the placer looks for machines that joined since.
PLACE_EVERY_S = 2.0


def register(sub) -> None:
    p = sub.add_parser("head", help="start a cluster head: Ray, coordinator, gateway, zeroconf advertisement",
                       description="Start the cluster's head and advertise it so `orchard join` finds it. "
                                   "Pass the same model options as `orchard serve`.")
    p.add_argument("--cluster", default=os.environ.get("ORCHARD_CLUSTER", DEFAULT_CLUSTER),
                   help="cluster name (default: $ORCHARD_CLUSTER or %(default)s)")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDRESS",
                   help="address Ray and the gateway listen on and that nodes reach (default: loopback only)")
    p.add_argument("--ray-port", type=int, default=DEFAULT_RAY_PORT, help="Ray GCS port (default %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port (default %(default)s)")
    p.add_argument("--token-file", type=Path, help="use this cluster token instead of the stored/created one")
    p.add_argument("--num-cpus", type=int, help="CPUs the head offers Ray (default: all)")
    p.add_argument("--no-serve-here", dest="serves", action="store_false",
                   help="do not run a model on the head machine itself")
    p.add_argument("--ray-only", action="store_true",
                   help="start Ray and the advertisement only; run `orchard serve --address` yourself")
    p.add_argument("--no-advertise", dest="advertise", action="store_false",
                   help="do not announce over zeroconf (nodes use `orchard join --head`)")
    p.add_argument("--object-store-mb", type=int, help="Ray object store size in MiB on the head")
    p.add_argument("--ray-temp-dir", help="Ray's temp folder on the head")
    _add_serve_options(p)
    p.set_defaults(func=run)


# `orchard serve` options that also make sense for a head (not its own Ray or bind choices).
SHARED_SERVE_OPTIONS = ("model", "api_key", "kv_memory", "block_size", "max_num_seqs", "max_model_len", "router",
                        "cold_tier", "cold_tier_gb", "served_model_name", "tokenizer", "chat_template",
                        "kv_memory_fraction", "dtype", "max_num_batched_tokens", "enable_prefix_caching", "seed",
                        "compiled_decode", "request_timeout", "max_queue", "max_body_mb", "grace", "tool_call_parser", "reasoning_parser")


def _add_serve_options(p) -> None:
    """Borrow `orchard serve`'s own model and gateway options, so the two never disagree."""
    actions = shared_serve_actions()
    group = p.add_argument_group("model and gateway (as in `orchard serve`)")
    for action in actions:
        group._add_action(action)  # what argparse's `parents=` does


def shared_serve_actions() -> list[argparse.Action]:
    holder = argparse.ArgumentParser(add_help=False)
    sub = holder.add_subparsers()
    serve.register(sub)
    return [a for a in sub.choices["serve"]._actions if a.dest in SHARED_SERVE_OPTIONS]


def serve_argv(args, config: HeadConfig) -> list[str]:
    """`orchard serve` attached to this head's Ray, with the shared options the user set."""
    argv = ["serve", "--address", config.ray_address, "--host", config.bind, "--port", str(config.gateway_port)]
    for action in shared_serve_actions():
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        if isinstance(value, bool):  # --enable-prefix-caching / --no-enable-prefix-caching
            argv.append(action.option_strings[0 if value else 1])
            continue
        for item in value if isinstance(value, list) else [value]:
            argv += [action.option_strings[0], str(item)]
    return argv


def config_from_args(args) -> HeadConfig:
    from orchard.cluster.discovery.cluster_token import validate_cluster_name

    ipaddress.ip_address(args.bind)  # a ValueError names a bad --bind early
    return HeadConfig(
        cluster=validate_cluster_name(args.cluster),
        bind=args.bind,
        ray_port=args.ray_port,
        gateway_port=args.port,
        num_cpus=args.num_cpus,
        serves=args.serves,
        ray_temp_dir=args.ray_temp_dir,
        object_store_memory=args.object_store_mb << 20 if args.object_store_mb else None,
        advertise=args.advertise,
    )


def run(args) -> int:
    from orchard.cluster.discovery import cluster_token as ct

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = config_from_args(args)
        if not args.ray_only:
            check_gateway_bind(args, config)
        token = _head_token(args, config.cluster)
    except (ct.ClusterTokenError, ValueError) as exc:
        print(f"orchard head: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals("stopping the head")
    argv = None if args.ray_only else serve_argv(args, config)
    return Head(config, token).run(stop, argv, grace_s=float(getattr(args, "grace", 30.0)))


def check_gateway_bind(args, config: HeadConfig) -> None:
    """The gateway's own rules, checked before Ray starts: no API key, no listening beyond
    loopback; no key shorter than `MIN_API_KEY_CHARS`."""
    from orchard.cluster.gateway.guard import check_api_keys

    keys = serve_options.api_keys(getattr(args, "api_key", []), dict(os.environ))
    check_api_keys(keys)
    serve_options.check_bind(config.bind, keys)


def _head_token(args, cluster: str) -> str:
    from orchard.cluster.discovery import cluster_token as ct

    if args.token_file:
        return ct.load_token_file(args.token_file)
    token, created = ct.load_or_create_token(cluster)
    if created:
        path = ct.token_path(cluster)
        print(f"New cluster token for {cluster!r} (shown once; stored in {path}, mode 600):\n\n  {token}\n\n"
              f"On each machine that joins, put it in the same place under its config folder, or set "
              f"${ct.TOKEN_ENV}.", flush=True)
    return token


def place_forever(serve_args) -> None:
    """The placer process: detached node actors (they do not depend on it) until SIGTERM."""
    from orchard.cluster.runtime.placement import Placer
    from orchard.cluster.runtime.ray_cluster import connect

    connect(serve_args.address)
    Placer(serve_options.engine_config(serve_args), PLACE_EVERY_S, detached=True).run()


def _main(argv: list[str]) -> int:
    """`python -m orchard.cluster.cli.head place <orchard serve argv>`: the placer process."""
    if not argv or argv[0] != "place":
        print("usage: python -m orchard.cluster.cli.head place serve --address ADDRESS [serve options]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    holder = argparse.ArgumentParser(prog="orchard-placer")
    serve.register(holder.add_subparsers())
    place_forever(holder.parse_args(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
