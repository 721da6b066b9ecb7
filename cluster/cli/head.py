"""`orchard head`: start a cluster's head and let other machines find it.

In order: the cluster token (created, stored 0600 and printed once on first start), the
Ray head with Ray's token authentication on, the coordinator and gateway attached to that
Ray (what `orchard serve --address` does), and finally the signed zeroconf advertisement.
Everything binds 127.0.0.1 unless `--bind` says otherwise; a head bound to loopback is
not advertised, since no other machine could reach it.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.commands.lifecycle import stop_on_signals

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


# `orchard serve` options that also make sense for a head (not its own Ray or bind choices).
SHARED_SERVE_OPTIONS = ("model", "api_key", "kv_memory", "block_size", "max_num_seqs", "max_model_len", "router",
                        "cold_tier", "cold_tier_gb",
                        "request_timeout", "max_queue", "max_body_mb", "grace")


def _add_serve_options(p) -> None:
    """Borrow `orchard serve`'s own model and gateway options, so the two never disagree."""
    actions = shared_serve_actions()
    if not actions:
        return
    group = p.add_argument_group("model and gateway (as in `orchard serve`)")
    for action in actions:
        group._add_action(action)  # what argparse's `parents=` does


def shared_serve_actions() -> list[argparse.Action]:
    serve = _serve_module()
    if serve is None:
        return []
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
        for item in value if isinstance(value, list) else [value]:
            argv += [action.option_strings[0], str(item)]
    return argv


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
        if not args.ray_only:
            check_gateway_bind(args, config)
        token = _head_token(args, config.cluster)
    except (ct.ClusterTokenError, ValueError) as exc:
        print(f"orchard head: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals("stopping the head")
    return Head(config, token).run(stop, args)


def check_gateway_bind(args, config: HeadConfig) -> None:
    """The gateway's own rule, checked before Ray starts: no API key, no listening beyond loopback."""
    serve = _serve_module()
    if serve is not None:
        serve.check_bind(config.bind, serve.api_keys(getattr(args, "api_key", []), dict(os.environ)))


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
        self._stop = threading.Event()
        self._serving = None
        self._advertiser = None

    def run(self, stop: threading.Event, args) -> int:
        self._stop = stop
        try:
            self._start_ray()
            if not args.ray_only:
                self._serving = start_serving(args, self.config, stop)
            self._advertise()
            print(f"orchard head {self.head_id}: Ray at {self.config.ray_address}"
                  + ("" if args.ray_only else f", gateway at {self.config.gateway_url}"), flush=True)
            while not stop.wait(0.5):
                if self._ray.poll() is not None:
                    log.error("the Ray head exited with status %s", self._ray.returncode)
                    return 1
                if self._serving is not None and self._serving.exited is not None:
                    log.error("`orchard serve` exited with status %s", self._serving.exited)
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
            self._serving.stop()
            self._serving = None
        if self._ray is not None:
            from node.agent import stop_process_group

            stop_process_group(self._ray, grace_s=30)
            self._ray = None

    def _start_ray(self) -> None:
        from cluster.ray_access import require_token_auth
        from node.agent import ray_environment, ray_executable

        # This process and its children talk to Ray too (coordinator, gateway): same token, same mode;
        # a loopback head keeps Ray's own ports on loopback as well.
        require_token_auth(self._ray_token, loopback=self.config.loopback)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env = ray_environment(self._ray_token)
        clear_stale_ray_address(self.config)
        cmd = ray_head_command(self.config, ray_executable())
        log.info("starting Ray: %s", " ".join(cmd))
        self._ray = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until_listening(self.config.bind, self.config.ray_port, self._ray, self.config.start_timeout_s, self._stop)

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


def wait_until_listening(host: str, port: int, child: subprocess.Popen, timeout_s: float,
                         stop: threading.Event) -> None:
    """Until the Ray head accepts TCP connections; HeadStartFailed if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if child.poll() is not None:
            raise HeadStartFailed(f"`ray start --head` exited with status {child.returncode}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise HeadStartFailed("stopped while starting" if stop.is_set() else
                          f"Ray did not listen on {host}:{port} within {timeout_s:.0f}s")


class Serving:
    """`orchard serve --address` as a child process (coordinator, first node actors, gateway),
    and a placer process that gives every machine joining later its node actor. Both are
    Ray drivers in processes of their own, so neither Ray's signal handling nor a driver
    losing its head can take the head process down."""

    def __init__(self, args, config: HeadConfig):
        self._argv = serve_argv(args, config)
        self._config = config
        self._grace_s = float(getattr(args, "grace", 30.0))
        self._serve: subprocess.Popen | None = None
        self._placer: subprocess.Popen | None = None

    def start(self, timeout_s: float, stop: threading.Event) -> None:
        cmd = [sys.executable, "-m", "cluster.cli", *self._argv]
        log.info("starting the coordinator and gateway: %s", " ".join(cmd))
        self._serve = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until_healthy(self._config.gateway_url, self._serve, timeout_s, stop)
        placer = [sys.executable, "-m", "cluster.commands.head", "place", *self._argv]
        self._placer = subprocess.Popen(placer, stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        from node.agent import stop_process_group

        if self._placer is not None:
            stop_process_group(self._placer, grace_s=10)
            self._placer = None
        if self._serve is not None:
            stop_process_group(self._serve, grace_s=self._grace_s + 15)
            self._serve = None

    @property
    def exited(self) -> int | None:
        for child in (self._serve, self._placer):
            if child is not None and child.poll() is not None:
                return child.returncode
        return None


PLACE_EVERY_S = 2.0


def place_forever(serve_args) -> None:
    """Every few seconds, a node actor on each serving Ray node that has none (detached, so
    it does not depend on this process). Runs until SIGTERM."""
    from cluster.ray_cluster import connect, place_node_actors

    engine = _serve_module().engine_config(serve_args)
    connect(serve_args.address)
    last_error = ""
    while True:
        try:
            for node_id in place_node_actors(engine, detached=True):
                log.info("node %s joined: its node actor is serving", node_id)
            last_error = ""
        except Exception as exc:  # e.g. a node that left mid-placement; try again next round
            if str(exc) != last_error:
                log.warning("placing node actors failed: %s", exc)
            last_error = str(exc)
        time.sleep(PLACE_EVERY_S)


def wait_until_healthy(url: str, child: subprocess.Popen, timeout_s: float, stop: threading.Event) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if child.poll() is not None:
            raise HeadStartFailed(f"`orchard serve` exited with status {child.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise HeadStartFailed("stopped while starting" if stop.is_set() else
                          f"the gateway at {url} was not healthy within {timeout_s:.0f}s")


def start_serving(args, config: HeadConfig, stop: threading.Event) -> Serving:
    if _serve_module() is None:
        raise HeadStartFailed("`orchard serve` is not available in this installation; use --ray-only")
    serving = Serving(args, config)
    try:
        serving.start(SERVE_START_TIMEOUT_S, stop)
    except BaseException:
        serving.stop()
        raise
    return serving


SERVE_START_TIMEOUT_S = 600.0


def _main(argv: list[str]) -> int:
    """`python -m cluster.commands.head place <orchard serve argv>`: the placer process."""
    if not argv or argv[0] != "place":
        print("usage: python -m cluster.commands.head place serve --address ADDRESS [serve options]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    holder = argparse.ArgumentParser(prog="orchard-placer")
    _serve_module().register(holder.add_subparsers())
    place_forever(holder.parse_args(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
