"""`orchard head`: start a cluster's head and let other machines find it.

In order: the cluster token (created, stored 0600 and printed once on first start), the
Ray head with Ray's token authentication on, the coordinator and gateway attached to that
Ray (what `orchard serve --address` does), and finally the signed zeroconf advertisement.
Everything binds 127.0.0.1 unless `--bind` says otherwise; a head bound to loopback is
not advertised, since no other machine could reach it.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CLUSTER = "orchard"
DEFAULT_RAY_PORT = 6379
DEFAULT_GATEWAY_PORT = 8000

log = logging.getLogger("orchard.head")


class HeadStartFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class HeadConfig:
    cluster: str = DEFAULT_CLUSTER
    bind: str = "127.0.0.1"
    ray_port: int = DEFAULT_RAY_PORT
    gateway_port: int = DEFAULT_GATEWAY_PORT
    num_cpus: int | None = None
    serves: bool = True  # the head machine is a serving node too (carries `orchard_node`)
    ray_temp_dir: str | None = None
    object_store_memory: int | None = None
    advertise: bool = True
    start_timeout_s: float = 60.0

    @property
    def ray_address(self) -> str:
        return f"{self.bind}:{self.ray_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.bind}:{self.gateway_port}"

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.bind).is_loopback


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


def _add_serve_options(p) -> None:
    """The model options of `orchard serve`, when that command offers them to share."""
    serve = _serve_module()
    if serve is None:
        return
    add = getattr(serve, "add_model_arguments", None)
    if add is not None:
        add(p)


def _serve_module():
    try:
        return importlib.import_module("cluster.commands.serve")
    except ModuleNotFoundError as exc:
        if exc.name != "cluster.commands.serve":
            raise
        return None


def config_from_args(args) -> HeadConfig:
    from cluster.cluster_token import validate_cluster_name

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
    from cluster import cluster_token as ct

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = config_from_args(args)
        token = _head_token(args, config.cluster)
    except (ct.ClusterTokenError, ValueError) as exc:
        print(f"orchard head: {exc}", file=sys.stderr)
        return 2
    stop = _stop_on_signals()
    return Head(config, token).run(stop, args)


def _head_token(args, cluster: str) -> str:
    from cluster import cluster_token as ct

    if args.token_file:
        return ct.load_token_file(args.token_file)
    token, created = ct.load_or_create_token(cluster)
    if created:
        path = ct.token_path(cluster)
        print(f"New cluster token for {cluster!r} (shown once; stored in {path}, mode 600):\n\n  {token}\n\n"
              f"On each machine that joins, put it in the same place under its config folder, or set "
              f"${ct.TOKEN_ENV}.", flush=True)
    return token


def ray_head_command(config: HeadConfig, ray: str) -> list[str]:
    import json

    cmd = [ray, "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard=false",
           "--node-ip-address", config.bind, "--port", str(config.ray_port)]
    if config.serves:
        cmd += ["--resources", json.dumps({"orchard_node": 1})]
    if config.num_cpus is not None:
        cmd += ["--num-cpus", str(config.num_cpus)]
    if config.ray_temp_dir:
        cmd += ["--temp-dir", config.ray_temp_dir]
    if config.object_store_memory:
        cmd += ["--object-store-memory", str(config.object_store_memory)]
    return cmd


class Head:
    """The processes and threads of one head run, stopped in reverse order of start."""

    def __init__(self, config: HeadConfig, token: str):
        from cluster import cluster_token as ct

        self.config = config
        self.head_id = secrets.token_hex(6)
        self._ray_token = ct.ray_auth_token(token)
        self._advert_key = ct.advert_key(token)
        self._ray: subprocess.Popen | None = None
        self._serving = None
        self._advertiser = None

    def run(self, stop: threading.Event, args) -> int:
        try:
            self._start_ray()
            if not args.ray_only:
                self._serving = start_serving(args, self.config)
            self._advertise()
            print(f"orchard head {self.head_id}: Ray at {self.config.ray_address}"
                  + ("" if args.ray_only else f", gateway at {self.config.gateway_url}"), flush=True)
            while not stop.wait(0.5):
                if self._ray.poll() is not None:
                    log.error("the Ray head exited with status %s", self._ray.returncode)
                    return 1
            return 0
        except HeadStartFailed as exc:
            print(f"orchard head: {exc}", file=sys.stderr)
            return 1
        finally:
            self.stop()

    def stop(self) -> None:
        if self._advertiser is not None:
            self._advertiser.close()  # goodbye first: nodes stop trusting this head at once
            self._advertiser = None
        if self._serving is not None:
            stop_serving(self._serving)
            self._serving = None
        if self._ray is not None:
            from node.agent import stop_process_group

            stop_process_group(self._ray, grace_s=30)
            self._ray = None

    def _start_ray(self) -> None:
        from node.agent import ray_environment, ray_executable

        env = ray_environment(self._ray_token)
        # This process talks to Ray too (coordinator, gateway): same token, same mode.
        os.environ.update({k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")})
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        clear_stale_ray_address(self.config)
        cmd = ray_head_command(self.config, ray_executable())
        log.info("starting Ray: %s", " ".join(cmd))
        self._ray = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until_listening(self.config.bind, self.config.ray_port, self._ray, self.config.start_timeout_s)

    def _advertise(self) -> None:
        from cluster.discovery import Advertisement, Advertiser, orchard_version

        if not self.config.advertise:
            return
        if self.config.loopback:
            log.warning("bound to %s: not advertising (no other machine could reach it); "
                        "pass --bind with this machine's LAN address to let nodes join", self.config.bind)
            return
        advert = Advertisement(self.config.cluster, self.config.ray_address, self.config.gateway_url,
                               orchard_version(), self.head_id, time.time())
        self._advertiser = Advertiser(advert, self._advert_key, self.config.bind)
        self._advertiser.start()


def clear_stale_ray_address(config: HeadConfig) -> None:
    """Forget a previous head's address file when nothing listens there any more.

    `ray start --head` refuses to start when its temp dir names this address as the current
    cluster and any process on the machine still carries `--gcs-address` for it, e.g. a
    worker raylet that has not yet noticed the old head is gone. The file is removed only
    when it names exactly this head's address and that port is closed.
    """
    from ray._private.utils import get_ray_address_file

    path = Path(get_ray_address_file(config.ray_temp_dir))
    try:
        if path.read_text().strip() != config.ray_address:
            return
    except OSError:
        return
    try:
        with socket.create_connection((config.bind, config.ray_port), timeout=1):
            return  # something does listen there: let Ray report it
    except OSError:
        pass
    log.info("removing the stale Ray address file %s", path)
    path.unlink(missing_ok=True)


def wait_until_listening(host: str, port: int, child: subprocess.Popen, timeout_s: float) -> None:
    """Until the Ray head accepts TCP connections; HeadStartFailed if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise HeadStartFailed(f"`ray start --head` exited with status {child.returncode}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise HeadStartFailed(f"Ray did not listen on {host}:{port} within {timeout_s:.0f}s")


def start_serving(args, config: HeadConfig):
    """The coordinator and gateway, attached to the Ray this head started, via `orchard serve`."""
    serve = _serve_module()
    if serve is None:
        raise HeadStartFailed("`orchard serve` is not available in this installation; use --ray-only")
    attach = getattr(serve, "start_attached", None)
    if attach is None:
        raise HeadStartFailed("`orchard serve` cannot attach to an existing Ray yet; use --ray-only")
    return attach(args, ray_address=config.ray_address, host=config.bind, port=config.gateway_port)


def stop_serving(serving) -> None:
    stop = getattr(serving, "stop", None)
    if stop is not None:
        stop()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame) -> None:
        log.info("%s: stopping the head", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
