"""Supervising a head: the Ray head process, `orchard serve` attached to it, the placer, the advert.

`orchard head` (orchard/cluster/cli/head.py) turns its options into a `HeadConfig` and the argv of
the serve child; `Head` starts the pieces in order and stops them in reverse. The serve
child and the placer are Ray drivers in processes of their own, so neither Ray's signal
handling nor a driver losing its head can take the head process down.
"""

from __future__ import annotations

import ipaddress
import json
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

import httpx

from orchard.cluster.discovery import cluster_token as ct
from orchard.cluster.discovery.adverts import Advertisement, Advertiser, orchard_version
from orchard.cluster.runtime.ray_access import require_token_auth
from orchard.node.serving.agent import ray_environment, ray_executable, stop_process_group

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


def ray_head_command(config: HeadConfig, ray: str) -> list[str]:
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
        self.config = config
        self.head_id = secrets.token_hex(6)
        self._ray_token = ct.ray_auth_token(token)
        self._advert_key = ct.advert_key(token)
        self._ray: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._serving = None
        self._advertiser = None

    def run(self, stop: threading.Event, serve_argv: list[str] | None, grace_s: float = 30.0) -> int:
        """Until `stop` is set or a child exits; `serve_argv` None: Ray and the advert only."""
        self._stop = stop
        try:
            self._start_ray()
            if serve_argv is not None:
                self._serving = start_serving(serve_argv, self.config, grace_s, stop)
            self._advertise()
            print(f"orchard head {self.head_id}: Ray at {self.config.ray_address}"
                  + ("" if serve_argv is None else f", gateway at {self.config.gateway_url}"), flush=True)
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
            stop_process_group(self._ray, grace_s=30)
            self._ray = None

    def _start_ray(self) -> None:
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

    def __init__(self, serve_argv: list[str], config: HeadConfig, grace_s: float):
        self._argv = serve_argv
        self._config = config
        self._grace_s = grace_s
        self._serve: subprocess.Popen | None = None
        self._placer: subprocess.Popen | None = None

    def start(self, timeout_s: float, stop: threading.Event) -> None:
        cmd = [sys.executable, "-m", "orchard.cluster.cli", *self._argv]
        log.info("starting the coordinator and gateway: %s", " ".join(cmd))
        self._serve = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until_healthy(self._config.gateway_url, self._serve, timeout_s, stop)
        placer = [sys.executable, "-m", "orchard.cluster.cli.head", "place", *self._argv]
        self._placer = subprocess.Popen(placer, stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
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


def wait_until_healthy(url: str, child: subprocess.Popen, timeout_s: float, stop: threading.Event) -> None:
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


SERVE_START_TIMEOUT_S = 600.0


def start_serving(serve_argv: list[str], config: HeadConfig, grace_s: float, stop: threading.Event) -> Serving:
    serving = Serving(serve_argv, config, grace_s)
    try:
        serving.start(SERVE_START_TIMEOUT_S, stop)
    except BaseException:
        serving.stop()
        raise
    return serving
