"""Bring mlx-orchard up on a running Ray cluster; the driver behind both submit paths.

    ray submit deploy/cluster.yaml deploy/serve.py -- --host 0.0.0.0
    ray job submit --address http://HEAD:8265 -- python deploy/serve.py --host 0.0.0.0

It attaches to the cluster it runs on (`--address auto`: the local head, or RAY_ADDRESS,
which Ray's job server sets), makes sure the coordinator lives on the head, starts a node
actor on every Ray node that offers the `orchard_node` resource, warms up, and serves the
gateway from this process. While it serves, machines that join the cluster later get
their node actor within `--place-every` seconds. Stopping the driver (Ctrl-C, SIGTERM,
`ray job stop`) drains the gateway and takes its node actors with it; the coordinator is
detached and stays for the next driver.

Every `orchard serve` option applies. Binding beyond loopback needs an API key
(`--api-key` or ORCHARD_API_KEYS, e.g. through `--runtime-env-json` for a job). The
cluster must run Ray's token authentication (RAY_AUTH_MODE=token, as deploy/cluster.yaml
starts it; a job inherits it from its raylet); without it the driver refuses to serve,
unless `--allow-unauthenticated-ray`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_PLACE_EVERY_S = 5.0


def parser() -> argparse.ArgumentParser:
    """`orchard serve`'s own options (so the two never disagree), attached by default."""
    from orchard.cluster.cli import serve

    holder = argparse.ArgumentParser(add_help=False)
    sub = holder.add_subparsers()
    serve.register(sub)
    p = sub.choices["serve"]
    p.prog = "deploy/serve.py"
    p.description = "Start the coordinator, a node actor on every `orchard_node` machine and the gateway " \
                    "on the running Ray cluster."
    p.set_defaults(address="auto", func=None)
    p.add_argument("--place-every", type=float, default=DEFAULT_PLACE_EVERY_S, metavar="S",
                   help="look for newly joined machines this often; 0 turns it off (default %(default)s)")
    p.add_argument("--allow-unauthenticated-ray", action="store_true",
                   help="attach even without RAY_AUTH_MODE=token (anyone who reaches Ray can run code)")
    return p


def main(argv: list[str] | None = None) -> int:
    from orchard.cluster.cli import serve, serve_options
    from orchard.cluster.runtime.ray_access import UnauthenticatedRay, check_driver_has_token
    from orchard.node.openblas import reexec_with_openblas

    args = parser().parse_args(argv)
    if args.no_ray:
        print("deploy/serve.py: --no-ray contradicts deploying on a Ray cluster", file=sys.stderr)
        return 2
    keys = serve_options.api_keys(args.api_key, dict(os.environ))
    try:
        if not args.allow_unauthenticated_ray:
            check_driver_has_token(dict(os.environ))
        serve_options.check_bind(args.host, keys)
        serve.bind(args.host, args.port).close()
    except (serve_options.InsecureBind, UnauthenticatedRay) as exc:
        print(f"deploy/serve.py: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"deploy/serve.py: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    reexec_with_openblas()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("orchard.placement").setLevel(logging.INFO)  # say when a machine joins
    return serve_with_placer(args, keys)


def serve_with_placer(args, keys: frozenset[str]) -> int:
    from orchard.cluster.cli import serve, serve_options
    from orchard.cluster.runtime.placement import Placer

    started = serve.start_backend(args)
    placer = Placer(serve_options.engine_config(args), args.place_every)
    stop_backend = started.stop

    def stop() -> None:
        placer.stop()
        stop_backend()

    started.stop = stop
    placer.start()
    return serve.serve_started(started, args, keys)


if __name__ == "__main__":
    code = main()
    # As `orchard serve` does: MLX's native threads can abort interpreter teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
